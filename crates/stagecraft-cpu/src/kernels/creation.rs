//! CPU kernels of the creation ops: fill, arange and the counter-based
//! random streams (Philox-4x32-10).
//!
//! # The random stream layout
//!
//! Every device must draw the same numbers, so the layout is part of the
//! op's contract. For a draw with attributes `seed` and `offset` (both
//! non-negative i64):
//!
//! * **Philox block `b`** is `philox4x32_10(counter, key)` with the 128-bit
//!   counter `offset + b` split into four u32 words, least significant
//!   first, and the key `(seed as u64) & 0xffff_ffff, (seed as u64) >> 32`.
//!   It yields four u32 words `w[0..4]`.
//! * **Elements per block** `E`: 4 for f32, f16 and bf16; 2 for f64.
//!   Element `i` of the output (row-major) comes from block `i / E`, lane
//!   `l = i % E`. So element `i` depends only on `(seed, offset, i)`, and
//!   the draw with offset `offset + k` equals this one's elements from
//!   `k * E` on.
//! * **Uniform** in `[low, high)`: `u = (w[l] >> 8) * 2^-24` (24 bits); for
//!   f64, `u = (x >> 11) * 2^-53` with `x = w[2l] | w[2l+1] << 32`. Then
//!   `v = low + u * (high - low)` in f64 without fused multiply-add
//!   (`low * (1 - u) + high * u` if `high - low` overflows), rounded to
//!   nearest in the dtype; a result outside `[low, high)` after rounding is
//!   replaced by the nearest dtype value inside it.
//! * **Normal** with `mean`, `std`: Box–Muller on `(u1, u2)`, `u1 ∈ (0, 1]`
//!   (one more than the uniform's integer, so `ln u1` is finite), `u2 ∈ [0,
//!   1)`, `r = sqrt(-2 ln u1)`, `θ = (2π) * u2`, the pair `(r cos θ, r sin
//!   θ)`. For f32, f16, bf16: lanes 0, 1 use `u1 = ((w[0] >> 8) + 1) *
//!   2^-24`, `u2 = (w[1] >> 8) * 2^-24` and lanes 2, 3 use words 2, 3 the
//!   same way; for f64, `u1` comes from words 0, 1 and `u2` from words 2, 3
//!   (53 bits each) for lanes 0, 1. Even lanes take the cosine, odd lanes
//!   the sine. The value is `mean + std * z` in f64, rounded to the dtype.
//!   (`ln`, `sqrt`, `cos` and `sin` are the platform's f64 functions, so
//!   another device may differ in the last bit of a normal draw.)
//!
//! Generation is parallel over chunks of elements; since each element is a
//! function of its own index, the chunking never changes the values.

use crate::{
    with_any_type, with_float_type, Inputs, Kernel, KernelContext, KernelRegistry, Outputs,
    PARALLEL_THRESHOLD,
};
use smallvec::smallvec;
use stagecraft_ops::{arange_len, Attrs};
use stagecraft_tensor::{
    bf16, f16, DenseHostTensor, Element, Error, Result, Scalar, ScalarHostTensor, TensorMetadata,
};
use std::sync::Arc;

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

pub(crate) fn register(registry: &mut KernelRegistry) {
    registry.add(&stagecraft_ops::FILL, fill_factory);
    registry.add(&stagecraft_ops::ARANGE, arange_factory);
    registry.add(&stagecraft_ops::RANDOM_UNIFORM, random_uniform_factory);
    registry.add(&stagecraft_ops::RANDOM_NORMAL, random_normal_factory);
}

/// A kernel without inputs, dtype-specialised up front.
type Create = fn(&KernelContext<'_>) -> Result<DenseHostTensor>;

fn creation_kernel(f: Create) -> Kernel {
    Arc::new(
        move |_: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> { Ok(smallvec![f(ctx)?]) },
    )
}

/// The metadata the metadata function computed for the single output.
fn output_meta(ctx: &KernelContext<'_>) -> Result<TensorMetadata> {
    ctx.outputs
        .first()
        .cloned()
        .ok_or_else(|| Error::internal("a creation kernel needs its output metadata"))
}

/// Runs `fill(chunk, first)` over pieces of `dst`, `first` being the
/// position of `chunk[0]`; in parallel above the threshold.
fn fill_chunks<T: Send>(dst: &mut [T], fill: impl Fn(&mut [T], usize) + Sync) {
    if dst.len() > PARALLEL_THRESHOLD {
        crate::pool::for_each_chunk(dst, CHUNK, |c, chunk| fill(chunk, c * CHUNK));
    } else {
        fill(dst, 0);
    }
}

// ------------------------------------------------------------------- fill

fn fill_factory(_: &Attrs<'_>, _: &[TensorMetadata]) -> Result<Kernel> {
    Ok(creation_kernel(|ctx| {
        let value = ctx.attrs.scalar("value")?;
        ScalarHostTensor::new(value, output_meta(ctx)?.shape).to_dense()
    }))
}

// ----------------------------------------------------------------- arange

fn arange_factory(attrs: &Attrs<'_>, _: &[TensorMetadata]) -> Result<Kernel> {
    Ok(creation_kernel(
        with_any_type!(attrs.dtype("dtype")?, T => arange::<T>),
    ))
}

fn arange<T: Element>(ctx: &KernelContext<'_>) -> Result<DenseHostTensor> {
    let (start, step) = (ctx.attrs.float("start")?, ctx.attrs.float("step")?);
    let len = arange_len(start, ctx.attrs.float("stop")?, step)?;
    let mut out = DenseHostTensor::zeros(TensorMetadata::new(T::DTYPE, [len]))?;
    fill_chunks(out.as_mut_slice::<T>()?, |chunk, first| {
        for (k, v) in chunk.iter_mut().enumerate() {
            *v = T::from_scalar(Scalar::F64(start + (first + k) as f64 * step));
        }
    });
    Ok(out)
}

// ------------------------------------------------------------------ philox

const PHILOX_M0: u32 = 0xD251_1F53;
const PHILOX_M1: u32 = 0xCD9E_8D57;
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;

/// Philox-4x32 with 10 rounds: a bijection of the 128-bit `counter` (four
/// words, least significant first) under the 64-bit `key`.
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    #[inline(always)]
    fn mulhilo(a: u32, b: u32) -> (u32, u32) {
        let p = a as u64 * b as u64;
        ((p >> 32) as u32, p as u32)
    }
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(PHILOX_W0);
            k1 = k1.wrapping_add(PHILOX_W1);
        }
        let (hi0, lo0) = mulhilo(PHILOX_M0, c0);
        let (hi1, lo1) = mulhilo(PHILOX_M1, c2);
        (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
    }
    [c0, c1, c2, c3]
}

/// The Philox stream of one draw: its key and first counter.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stream {
    key: [u32; 2],
    offset: u64,
}

impl Stream {
    pub(crate) fn new(seed: i64, offset: i64) -> Result<Stream> {
        let offset = u64::try_from(offset).map_err(|_| {
            Error::attribute(format!("`offset` must be non-negative, got {offset}"))
        })?;
        let seed = seed as u64;
        Ok(Stream {
            key: [seed as u32, (seed >> 32) as u32],
            offset,
        })
    }

    fn from_attrs(attrs: &Attrs<'_>) -> Result<Stream> {
        Stream::new(attrs.int("seed")?, attrs.int("offset")?)
    }

    /// The four words of block `b`.
    #[inline]
    pub(crate) fn block(&self, b: u64) -> [u32; 4] {
        let c = self.offset as u128 + b as u128;
        philox4x32_10(
            [
                c as u32,
                (c >> 32) as u32,
                (c >> 64) as u32,
                (c >> 96) as u32,
            ],
            self.key,
        )
    }
}

/// Writes elements `first..first + dst.len()` of a stream with `per_block`
/// elements per Philox block, `values` turning one block's words into its
/// elements (lanes past `per_block` are ignored).
fn generate<T: Copy>(
    dst: &mut [T],
    first: u64,
    stream: &Stream,
    per_block: usize,
    values: impl Fn([u32; 4]) -> [T; 4],
) {
    let e = per_block as u64;
    let mut i = first;
    let mut k = 0;
    while k < dst.len() {
        let lane = (i % e) as usize;
        let block = values(stream.block(i / e));
        let n = (per_block - lane).min(dst.len() - k);
        dst[k..k + n].copy_from_slice(&block[lane..lane + n]);
        k += n;
        i += n as u64;
    }
}

/// `(w >> 8) * 2^-24`: 24 random bits as a uniform in `[0, 1)`.
#[inline]
fn unit24(w: u32) -> f64 {
    (w >> 8) as f64 * (1.0 / (1u64 << 24) as f64)
}

/// 53 random bits of `lo | hi << 32` as a uniform in `[0, 1)`.
#[inline]
fn unit53(lo: u32, hi: u32) -> f64 {
    ((lo as u64 | (hi as u64) << 32) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The float dtypes random values are drawn in.
pub trait RandomElement: Element {
    /// True for f64, whose uniforms take two Philox words (two elements
    /// per block instead of four).
    const WIDE: bool;
    /// Rounds to nearest.
    fn round_from(v: f64) -> Self;
    /// The neighbouring value towards +∞ (`up`) or −∞; zero steps to the
    /// smallest subnormal of that sign. Not for NaN.
    fn step(self, up: bool) -> Self;
}

macro_rules! random_element {
    ($t:ty, $bits:ty, $wide:expr, $round:expr) => {
        impl RandomElement for $t {
            const WIDE: bool = $wide;
            #[inline]
            fn round_from(v: f64) -> Self {
                $round(v)
            }
            fn step(self, up: bool) -> Self {
                let bits: $bits = self.to_bits();
                let sign: $bits = 1 << (<$bits>::BITS - 1);
                let next = if bits & !sign == 0 {
                    if up {
                        1
                    } else {
                        sign | 1
                    }
                } else if up == (bits & sign == 0) {
                    bits + 1
                } else {
                    bits - 1
                };
                <$t>::from_bits(next)
            }
        }
    };
}

random_element!(f16, u16, false, f16::from_f64);
random_element!(bf16, u16, false, bf16::from_f64);
random_element!(f32, u32, false, |v: f64| v as f32);
random_element!(f64, u64, true, |v: f64| v);

/// Elements per Philox block for dtype `T`.
fn per_block<T: RandomElement>() -> usize {
    if T::WIDE {
        2
    } else {
        4
    }
}

// ----------------------------------------------------------------- uniform

/// A uniform draw's bounds and the dtype values it is clamped into.
#[derive(Clone, Copy, Debug)]
struct UniformRange<T> {
    low: f64,
    high: f64,
    /// `high - low` is finite.
    finite_range: bool,
    lowest: T,
    highest: T,
}

impl<T: RandomElement> UniformRange<T> {
    fn new(low: f64, high: f64) -> Result<UniformRange<T>> {
        if !low.is_finite() || !high.is_finite() || low >= high {
            return Err(Error::attribute(format!(
                "need finite low < high, got [{low}, {high})"
            )));
        }
        let mut lowest = T::round_from(low);
        if lowest.to_f64() < low {
            lowest = lowest.step(true);
        }
        let mut highest = T::round_from(high);
        if highest.to_f64() >= high {
            highest = highest.step(false);
        }
        if lowest.to_f64() > highest.to_f64() {
            return Err(Error::attribute(format!(
                "no {} value lies in [{low}, {high})",
                T::DTYPE
            )));
        }
        Ok(UniformRange {
            low,
            high,
            finite_range: (high - low).is_finite(),
            lowest,
            highest,
        })
    }

    #[inline]
    fn map(&self, u: f64) -> T {
        let v = if self.finite_range {
            self.low + u * (self.high - self.low)
        } else {
            self.low * (1.0 - u) + self.high * u
        };
        let t = T::round_from(v);
        if t > self.highest {
            self.highest
        } else if t < self.lowest {
            self.lowest
        } else {
            t
        }
    }
}

/// Writes uniform elements `first..first + dst.len()` of `stream`.
fn uniform_range<T: RandomElement>(
    dst: &mut [T],
    first: u64,
    stream: &Stream,
    range: &UniformRange<T>,
) {
    if T::WIDE {
        generate(dst, first, stream, per_block::<T>(), |w| {
            let (a, b) = (range.map(unit53(w[0], w[1])), range.map(unit53(w[2], w[3])));
            [a, b, a, b]
        });
    } else {
        generate(dst, first, stream, per_block::<T>(), |w| {
            w.map(|x| range.map(unit24(x)))
        });
    }
}

fn random_uniform_factory(attrs: &Attrs<'_>, _: &[TensorMetadata]) -> Result<Kernel> {
    let dtype = attrs.dtype("dtype")?;
    Ok(creation_kernel(
        with_float_type!(dtype, T => random_uniform::<T>, _ => {
            return Err(Error::dtype(format!("random values need a float dtype, got {dtype}")))
        }),
    ))
}

fn random_uniform<T: RandomElement>(ctx: &KernelContext<'_>) -> Result<DenseHostTensor> {
    let stream = Stream::from_attrs(&ctx.attrs)?;
    let range = UniformRange::<T>::new(ctx.attrs.float("low")?, ctx.attrs.float("high")?)?;
    let mut out = DenseHostTensor::zeros(TensorMetadata::new(T::DTYPE, output_meta(ctx)?.shape))?;
    fill_chunks(out.as_mut_slice::<T>()?, |chunk, first| {
        uniform_range(chunk, first as u64, &stream, &range)
    });
    Ok(out)
}

// ------------------------------------------------------------------ normal

/// Box–Muller: the pair `(r cos θ, r sin θ)` for `u1 ∈ (0, 1]`, `u2 ∈ [0, 1)`.
#[inline]
fn box_muller(u1: f64, u2: f64) -> (f64, f64) {
    let r = (-2.0 * u1.ln()).sqrt();
    let theta = 2.0 * std::f64::consts::PI * u2;
    (r * theta.cos(), r * theta.sin())
}

/// Writes normal elements `first..first + dst.len()` of `stream`.
fn normal_range<T: RandomElement>(dst: &mut [T], first: u64, stream: &Stream, mean: f64, std: f64) {
    let finish = |z: f64| T::round_from(mean + std * z);
    if T::WIDE {
        generate(dst, first, stream, per_block::<T>(), |w| {
            let u1 = unit53(w[0], w[1]) + 1.0 / (1u64 << 53) as f64;
            let (a, b) = box_muller(u1, unit53(w[2], w[3]));
            let (a, b) = (finish(a), finish(b));
            [a, b, a, b]
        });
    } else {
        generate(dst, first, stream, per_block::<T>(), |w| {
            let step = 1.0 / (1u64 << 24) as f64;
            let (a, b) = box_muller(unit24(w[0]) + step, unit24(w[1]));
            let (c, d) = box_muller(unit24(w[2]) + step, unit24(w[3]));
            [finish(a), finish(b), finish(c), finish(d)]
        });
    }
}

fn random_normal_factory(attrs: &Attrs<'_>, _: &[TensorMetadata]) -> Result<Kernel> {
    let dtype = attrs.dtype("dtype")?;
    Ok(creation_kernel(
        with_float_type!(dtype, T => random_normal::<T>, _ => {
            return Err(Error::dtype(format!("random values need a float dtype, got {dtype}")))
        }),
    ))
}

fn random_normal<T: RandomElement>(ctx: &KernelContext<'_>) -> Result<DenseHostTensor> {
    let stream = Stream::from_attrs(&ctx.attrs)?;
    let (mean, std) = (ctx.attrs.float("mean")?, ctx.attrs.float("std")?);
    let mut out = DenseHostTensor::zeros(TensorMetadata::new(T::DTYPE, output_meta(ctx)?.shape))?;
    fill_chunks(out.as_mut_slice::<T>()?, |chunk, first| {
        normal_range(chunk, first as u64, &stream, mean, std)
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::creation as reference;
    use stagecraft_ops::{OpAttrs, OpDef};
    use stagecraft_tensor::DType;

    fn run(def: &'static OpDef, attrs: &OpAttrs) -> Result<DenseHostTensor> {
        let out_meta = def.infer(&[], attrs)?;
        let factory = crate::registry().get(def).expect("kernel registered");
        let kernel = factory(&Attrs::new(attrs, def), &[])?;
        let ctx = KernelContext {
            attrs: Attrs::new(attrs, def),
            outputs: &out_meta,
        };
        let mut out = kernel(Inputs::new(), &ctx)?;
        assert_eq!(out.len(), 1);
        assert_eq!(
            out[0].metadata(),
            &out_meta[0],
            "{} output metadata",
            def.name
        );
        Ok(out.remove(0))
    }

    fn values(t: &DenseHostTensor) -> Vec<f64> {
        (0..t.numel())
            .map(|i| t.get_scalar(i).unwrap().to_f64())
            .collect()
    }

    const FLOATS: [DType; 4] = [DType::F16, DType::BF16, DType::F32, DType::F64];

    #[test]
    fn philox_known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
        // The counter carries across words.
        let s = Stream::new(5, u32::MAX as i64).unwrap();
        assert_eq!(s.block(1), philox4x32_10([0, 1, 0, 0], [5, 0]));
        let s = Stream::new(-1, i64::MAX).unwrap();
        assert_eq!(
            s.block(u64::MAX),
            philox4x32_10([u32::MAX - 1, u32::MAX >> 1, 1, 0], [u32::MAX; 2])
        );
    }

    #[test]
    fn fill_matches_reference() {
        for value in [
            Scalar::Bool(true),
            Scalar::I32(-7),
            Scalar::I64(1 << 40),
            Scalar::F16(f16::from_f32(1.5)),
            Scalar::BF16(bf16::from_f32(-2.0)),
            Scalar::F32(f32::NAN),
            Scalar::F64(0.25),
        ] {
            for dims in [vec![], vec![0], vec![2, 3], vec![40_000]] {
                let mut a = OpAttrs::new();
                a.set_dims("shape", &dims).set_scalar("value", value);
                let out = run(&stagecraft_ops::FILL, &a).unwrap();
                let want = reference::fill(value, dims.iter().product());
                let got = values(&out);
                assert_eq!(got.len(), want.len());
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(g, w)| g == w || (g.is_nan() && w.is_nan())),
                    "{value:?}"
                );
            }
        }
    }

    #[test]
    fn arange_matches_reference() {
        for dtype in [
            DType::I32,
            DType::I64,
            DType::F16,
            DType::BF16,
            DType::F32,
            DType::F64,
        ] {
            for (start, stop, step) in [
                (0.0, 10.0, 1.0),
                (5.0, -3.0, -1.5),
                (0.0, 1.0, 0.1),
                (3.0, 3.0, 1.0),
                (1.0, 0.0, 1.0),
                (-2.0, 40_000.0, 1.0),
            ] {
                let mut a = OpAttrs::new();
                a.set_float("start", start)
                    .set_float("stop", stop)
                    .set_float("step", step)
                    .set_dtype("dtype", dtype);
                let out = run(&stagecraft_ops::ARANGE, &a).unwrap();
                assert_eq!(
                    values(&out),
                    reference::arange(start, stop, step, dtype).unwrap(),
                    "{dtype} {start}..{stop}"
                );
            }
        }
        let mut a = OpAttrs::new();
        a.set_float("stop", 4.0).set_float("step", 0.0);
        assert!(run(&stagecraft_ops::ARANGE, &a).is_err());
    }

    fn uniform_attrs(
        dims: &[usize],
        dtype: DType,
        seed: i64,
        offset: i64,
        low: f64,
        high: f64,
    ) -> OpAttrs {
        let mut a = OpAttrs::new();
        a.set_dims("shape", dims)
            .set_dtype("dtype", dtype)
            .set_int("seed", seed)
            .set_int("offset", offset)
            .set_float("low", low)
            .set_float("high", high);
        a
    }

    fn normal_attrs(
        dims: &[usize],
        dtype: DType,
        seed: i64,
        offset: i64,
        mean: f64,
        std: f64,
    ) -> OpAttrs {
        let mut a = OpAttrs::new();
        a.set_dims("shape", dims)
            .set_dtype("dtype", dtype)
            .set_int("seed", seed)
            .set_int("offset", offset)
            .set_float("mean", mean)
            .set_float("std", std);
        a
    }

    #[test]
    fn random_matches_reference() {
        for dtype in FLOATS {
            for (dims, seed, offset) in [
                (vec![], 0i64, 0i64),
                (vec![0, 3], 1, 2),
                (vec![7], 42, 5),
                (vec![3, 5], i64::MAX, 1 << 40),
                (vec![50_001], 9, 3),
            ] {
                let count = dims.iter().product();
                let u = run(
                    &stagecraft_ops::RANDOM_UNIFORM,
                    &uniform_attrs(&dims, dtype, seed, offset, -2.0, 3.0),
                )
                .unwrap();
                assert_eq!(
                    values(&u),
                    reference::random_uniform(seed as u64, offset as u64, count, dtype, -2.0, 3.0),
                    "uniform {dtype} {dims:?}"
                );
                let n = run(
                    &stagecraft_ops::RANDOM_NORMAL,
                    &normal_attrs(&dims, dtype, seed, offset, 1.0, 2.0),
                )
                .unwrap();
                assert_eq!(
                    values(&n),
                    reference::random_normal(seed as u64, offset as u64, count, dtype, 1.0, 2.0),
                    "normal {dtype} {dims:?}"
                );
            }
        }
    }

    /// Elements `first..first + len` of a uniform and a normal stream,
    /// generated in pieces of `piece` elements.
    fn pieces<T: RandomElement>(
        stream: &Stream,
        first: u64,
        len: usize,
        piece: usize,
    ) -> (Vec<T>, Vec<T>) {
        let range = UniformRange::<T>::new(-1.0, 1.0).unwrap();
        let (mut u, mut n) = (vec![T::default(); len], vec![T::default(); len]);
        for (c, chunk) in u.chunks_mut(piece).enumerate() {
            uniform_range(chunk, first + (c * piece) as u64, stream, &range);
        }
        for (c, chunk) in n.chunks_mut(piece).enumerate() {
            normal_range(chunk, first + (c * piece) as u64, stream, 0.0, 1.0);
        }
        (u, n)
    }

    fn chunking_invariance<T: RandomElement>() {
        let stream = Stream::new(1234, 77).unwrap();
        let whole = pieces::<T>(&stream, 0, 1000, 1000);
        for piece in [1, 2, 3, 5, 64, 333] {
            assert_eq!(
                pieces::<T>(&stream, 0, 1000, piece),
                whole,
                "{} in pieces of {piece}",
                T::DTYPE
            );
        }
        // A sub-range starting mid-block equals the same elements of the whole.
        let (u, n) = pieces::<T>(&stream, 13, 500, 7);
        assert_eq!((&u[..], &n[..]), (&whole.0[13..513], &whole.1[13..513]));
        // Shifting the offset by k blocks skips k * E elements.
        let e = per_block::<T>();
        let shifted = Stream::new(1234, 77 + 10).unwrap();
        let (u, n) = pieces::<T>(&shifted, 0, 1000 - 10 * e, 1000);
        assert_eq!((&u[..], &n[..]), (&whole.0[10 * e..], &whole.1[10 * e..]));
    }

    #[test]
    fn values_do_not_depend_on_chunking() {
        chunking_invariance::<f16>();
        chunking_invariance::<bf16>();
        chunking_invariance::<f32>();
        chunking_invariance::<f64>();
    }

    #[test]
    fn parallel_draws_equal_sequential_ones() {
        // 100_003 elements run on the rayon pool; the reference computes
        // each element on its own.
        for dtype in FLOATS {
            let dims = [100_003];
            let u = run(
                &stagecraft_ops::RANDOM_UNIFORM,
                &uniform_attrs(&dims, dtype, 7, 11, 0.0, 1.0),
            )
            .unwrap();
            assert_eq!(
                values(&u),
                reference::random_uniform(7, 11, dims[0], dtype, 0.0, 1.0)
            );
            // The offset shifted by k blocks draws the whole draw's tail.
            let e = if dtype == DType::F64 { 2 } else { 4 };
            let tail_dims = [dims[0] - 1000 * e];
            let tail = run(
                &stagecraft_ops::RANDOM_UNIFORM,
                &uniform_attrs(&tail_dims, dtype, 7, 1011, 0.0, 1.0),
            )
            .unwrap();
            assert_eq!(values(&tail)[..], values(&u)[1000 * e..]);
            let n = run(
                &stagecraft_ops::RANDOM_NORMAL,
                &normal_attrs(&dims, dtype, 7, 11, 0.0, 1.0),
            )
            .unwrap();
            assert_eq!(
                values(&n),
                reference::random_normal(7, 11, dims[0], dtype, 0.0, 1.0)
            );
        }
    }

    fn mean_and_variance(v: &[f64]) -> (f64, f64) {
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / v.len() as f64;
        (mean, var)
    }

    #[test]
    fn statistics_are_sane() {
        const N: usize = 1_000_000;
        for dtype in FLOATS {
            let (low, high) = (-2.0, 3.0);
            let u = values(
                &run(
                    &stagecraft_ops::RANDOM_UNIFORM,
                    &uniform_attrs(&[N], dtype, 2024, 0, low, high),
                )
                .unwrap(),
            );
            assert!(
                u.iter().all(|&x| (low..high).contains(&x)),
                "{dtype} uniform out of range"
            );
            let (mean, var) = mean_and_variance(&u);
            // Standard errors: 5 / sqrt(12 N) ≈ 0.0014 for the mean, about
            // 0.0019 for the variance (25/12 ≈ 2.083); allow ~5 of them, plus
            // the rounding of the coarse dtypes.
            let slack = if dtype == DType::BF16 { 0.02 } else { 0.0 };
            assert!(
                (mean - 0.5).abs() < 0.008 + slack,
                "{dtype} uniform mean {mean}"
            );
            assert!(
                (var - 25.0 / 12.0).abs() < 0.01 + slack,
                "{dtype} uniform variance {var}"
            );
            let n = values(
                &run(
                    &stagecraft_ops::RANDOM_NORMAL,
                    &normal_attrs(&[N], dtype, 2024, 0, 1.0, 2.0),
                )
                .unwrap(),
            );
            assert!(n.iter().all(|x| x.is_finite()));
            let (mean, var) = mean_and_variance(&n);
            // Standard errors: 0.002 for the mean, 4 * sqrt(2 / N) ≈ 0.0057
            // for the variance.
            assert!(
                (mean - 1.0).abs() < 0.01 + slack,
                "{dtype} normal mean {mean}"
            );
            assert!(
                (var - 4.0).abs() < 0.03 + slack,
                "{dtype} normal variance {var}"
            );
            // About 68.3% within one standard deviation.
            let inside = n.iter().filter(|&&x| (x - 1.0).abs() < 2.0).count() as f64 / N as f64;
            assert!(
                (inside - 0.6827).abs() < 0.005 + slack,
                "{dtype} normal one-sigma share {inside}"
            );
        }
    }

    #[test]
    fn uniform_stays_below_high_after_rounding() {
        // In f16 most of [1000, 1000.5) rounds up to 1000.5; the clamp keeps
        // every value below `high`.
        let u = values(
            &run(
                &stagecraft_ops::RANDOM_UNIFORM,
                &uniform_attrs(&[5000], DType::F16, 3, 0, 1000.0, 1000.5),
            )
            .unwrap(),
        );
        assert!(u.iter().all(|&x| x == 1000.0), "{:?}", &u[..8]);
        // Bounds beyond the dtype's range clamp to its finite values.
        let u = values(
            &run(
                &stagecraft_ops::RANDOM_UNIFORM,
                &uniform_attrs(&[5000], DType::F16, 3, 0, -1e6, 1e6),
            )
            .unwrap(),
        );
        assert!(u.iter().all(|&x| (-65504.0..=65504.0).contains(&x)));
        assert_eq!(
            u,
            reference::random_uniform(3, 0, 5000, DType::F16, -1e6, 1e6)
        );
        // A range too narrow for the dtype is an error, not a wrong value.
        let err = run(
            &stagecraft_ops::RANDOM_UNIFORM,
            &uniform_attrs(&[2], DType::F16, 3, 0, 1000.1, 1000.2),
        )
        .unwrap_err();
        assert!(err.to_string().contains("no f16 value"), "{err}");
        // An overflowing `high - low` still gives finite values.
        let f = values(
            &run(
                &stagecraft_ops::RANDOM_UNIFORM,
                &uniform_attrs(&[1000], DType::F64, 3, 0, -1.5e308, 1.5e308),
            )
            .unwrap(),
        );
        assert!(f.iter().all(|&x| (-1.5e308..1.5e308).contains(&x)));
        assert_eq!(
            f,
            reference::random_uniform(3, 0, 1000, DType::F64, -1.5e308, 1.5e308)
        );
        assert!(f.iter().any(|&x| x > 1e307) && f.iter().any(|&x| x < -1e307));
    }

    #[test]
    fn neighbours_step_by_one_ulp() {
        assert_eq!(1.0f32.step(false), 1.0 - f32::EPSILON / 2.0);
        assert_eq!((-1.0f64).step(true), -1.0 + f64::EPSILON / 2.0);
        assert_eq!(f16::INFINITY.step(false), f16::MAX);
        assert_eq!(bf16::NEG_INFINITY.step(true), bf16::MIN);
        assert_eq!(0.0f32.step(true), f32::from_bits(1));
        assert!((-0.0f64).step(false) < 0.0);
    }

    #[test]
    fn normal_with_zero_std_is_the_mean() {
        let n = values(
            &run(
                &stagecraft_ops::RANDOM_NORMAL,
                &normal_attrs(&[100], DType::BF16, 1, 0, 0.5, 0.0),
            )
            .unwrap(),
        );
        assert!(n.iter().all(|&x| x == 0.5));
    }
}
