//! Element arithmetic shared by every interpretation of an elementwise op:
//! the [`Num`] trait over the numeric element types, and the scalar
//! functions the op definitions are written with.
//!
//! An elementwise op's meaning is one function generic over [`Num`]
//! (`defs/elementwise.rs`); the eager CPU kernel, the fused interpreter
//! and the f64 reference kernel all instantiate that same function, so
//! they agree by construction.
//!
//! Floating-point functions are evaluated in f64 and rounded once to the
//! element type: glibc's f64 functions are within about 1 ulp, so the
//! rounded f32, f16 and bf16 results are correctly rounded except within
//! 2^-29 ulp of a tie (`docs/accuracy.md`).

use half::{bf16, f16};

/// A float function with two forms, applied to `x` of a [`Num`] type:
/// `wide` is the meaning (used for f64), `narrow` a form accurate enough
/// for a result rounded to f32 or narrower that vectorizes (used for
/// those). A macro making direct calls, not a method taking the two
/// functions: called through its `Fn` shim, a large narrow form (GELU's)
/// stayed a call per element and its loop did not vectorize.
macro_rules! float_fn {
    ($x:expr, $wide:path, $narrow:path) => {{
        #[inline(always)]
        fn wide_or_narrow<T: $crate::scalar::Num>(x: T) -> T {
            if T::NARROW {
                T::from_f64($narrow(x.to_f64()))
            } else {
                T::from_f64($wide(x.to_f64()))
            }
        }
        wide_or_narrow($x)
    }};
}
pub(crate) use float_fn;

/// A numeric element type as the elementwise op definitions see it:
/// integers wrap on overflow, floats round to nearest.
pub trait Num: Copy + PartialOrd + Send + Sync + 'static {
    /// True for the floating-point types.
    const FLOAT: bool;
    /// True for float types narrower than f64, whose results may come
    /// from the cheaper `narrow` form of a function (see `float_fn!` here).
    const NARROW: bool;
    /// Zero.
    const ZERO: Self;
    /// One.
    const ONE: Self;
    /// The value as f64 (exact, except i64 beyond 2^53).
    fn to_f64(self) -> f64;
    /// `v` converted with the `Cast` rules: floats round to nearest once
    /// (ties to even), integers truncate toward zero and saturate, NaN
    /// becomes 0.
    fn from_f64(v: f64) -> Self;
    /// `self + o` (integers wrap).
    fn add(self, o: Self) -> Self;
    /// `self - o` (integers wrap).
    fn sub(self, o: Self) -> Self;
    /// `self * o` (integers wrap).
    fn mul(self, o: Self) -> Self;
    /// `self / o`; integers truncate and wrap (`MIN / -1 = MIN`). A zero
    /// integer divisor is rejected by the kernels before the loop; here it
    /// divides by 1, so the loop has no panic path.
    fn div(self, o: Self) -> Self;
    /// `-self` (integers wrap).
    fn neg(self) -> Self;
    /// `|self|` (integers wrap: `|MIN| = MIN`).
    fn abs(self) -> Self;
    /// True for a NaN.
    fn is_nan(self) -> bool;
    /// `self & o` (integers; the bitwise ops' dtype class keeps floats
    /// out, for which it returns `self`).
    fn bit_and(self, o: Self) -> Self;
    /// `self | o` (integers; floats return `self`).
    fn bit_or(self, o: Self) -> Self;
    /// `self ^ o` (integers; floats return `self`).
    fn bit_xor(self, o: Self) -> Self;
    /// `!self`, every bit flipped (integers; floats return `self`).
    fn bit_not(self) -> Self;
    /// `self << o`; an amount outside `0..bits` shifts every bit out
    /// (giving 0). Integers; floats return `self`.
    fn shift_left(self, o: Self) -> Self;
    /// `self >> o`, arithmetic for signed types (the sign fills in) and
    /// logical for unsigned ones; an amount outside `0..bits` shifts every
    /// bit out (giving 0, or -1 for a negative signed value). Integers;
    /// floats return `self`.
    fn shift_right(self, o: Self) -> Self;

    /// `f` of the value, computed in f64 and rounded once.
    #[inline(always)]
    fn via_f64(self, f: impl Fn(f64) -> f64) -> Self {
        Self::from_f64(f(self.to_f64()))
    }

    /// The larger value; a NaN on either side wins.
    #[inline(always)]
    fn maximum(self, o: Self) -> Self {
        if self > o || self.is_nan() {
            self
        } else {
            o
        }
    }

    /// The smaller value; a NaN on either side wins.
    #[inline(always)]
    fn minimum(self, o: Self) -> Self {
        if self < o || self.is_nan() {
            self
        } else {
            o
        }
    }
}

macro_rules! int_num {
    ($($t:ty),*) => {$(
        impl Num for $t {
            const FLOAT: bool = false;
            const NARROW: bool = false;
            const ZERO: $t = 0;
            const ONE: $t = 1;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_f64(v: f64) -> $t {
                v as $t
            }
            #[inline(always)]
            fn add(self, o: $t) -> $t {
                self.wrapping_add(o)
            }
            #[inline(always)]
            fn sub(self, o: $t) -> $t {
                self.wrapping_sub(o)
            }
            #[inline(always)]
            fn mul(self, o: $t) -> $t {
                self.wrapping_mul(o)
            }
            #[inline(always)]
            fn div(self, o: $t) -> $t {
                self.wrapping_div(if o == 0 { 1 } else { o })
            }
            #[inline(always)]
            fn neg(self) -> $t {
                (0 as $t).wrapping_sub(self)
            }
            #[inline(always)]
            fn abs(self) -> $t {
                if self < (0 as $t) { self.neg() } else { self }
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                false
            }
            #[inline(always)]
            fn bit_and(self, o: $t) -> $t {
                self & o
            }
            #[inline(always)]
            fn bit_or(self, o: $t) -> $t {
                self | o
            }
            #[inline(always)]
            fn bit_xor(self, o: $t) -> $t {
                self ^ o
            }
            #[inline(always)]
            fn bit_not(self) -> $t {
                !self
            }
            #[inline(always)]
            fn shift_left(self, o: $t) -> $t {
                // `o` in 0..bits, as a u32 (a negative amount is out).
                match u32::try_from(o) {
                    Ok(k) if k < <$t>::BITS => self << k,
                    _ => 0,
                }
            }
            #[inline(always)]
            fn shift_right(self, o: $t) -> $t {
                match u32::try_from(o) {
                    Ok(k) if k < <$t>::BITS => self >> k,
                    // Every bit out: what a shift by bits - 1 leaves of
                    // the sign (0 for unsigned types and non-negatives).
                    _ => self >> (<$t>::BITS - 1) >> 1,
                }
            }
        }
    )*};
}
int_num!(u8, i8, u16, i16, u32, i32, u64, i64);

/// The bitwise methods of [`Num`] for a float type: not defined there
/// (the bitwise ops accept integers alone), so each returns its first
/// operand.
macro_rules! float_bit_ops {
    ($t:ty) => {
        #[inline(always)]
        fn bit_and(self, _: $t) -> $t {
            self
        }
        #[inline(always)]
        fn bit_or(self, _: $t) -> $t {
            self
        }
        #[inline(always)]
        fn bit_xor(self, _: $t) -> $t {
            self
        }
        #[inline(always)]
        fn bit_not(self) -> $t {
            self
        }
        #[inline(always)]
        fn shift_left(self, _: $t) -> $t {
            self
        }
        #[inline(always)]
        fn shift_right(self, _: $t) -> $t {
            self
        }
    };
}
macro_rules! float_num {
    ($($t:ty: $narrow:expr),*) => {$(
        impl Num for $t {
            const FLOAT: bool = true;
            const NARROW: bool = $narrow;
            const ZERO: $t = 0.0;
            const ONE: $t = 1.0;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_f64(v: f64) -> $t {
                v as $t
            }
            #[inline(always)]
            fn add(self, o: $t) -> $t {
                self + o
            }
            #[inline(always)]
            fn sub(self, o: $t) -> $t {
                self - o
            }
            #[inline(always)]
            fn mul(self, o: $t) -> $t {
                self * o
            }
            #[inline(always)]
            fn div(self, o: $t) -> $t {
                self / o
            }
            #[inline(always)]
            fn neg(self) -> $t {
                -self
            }
            #[inline(always)]
            fn abs(self) -> $t {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            float_bit_ops!($t);
        }
    )*};
}
float_num!(f32: true, f64: false);

// f16 and bf16 compute in f32: its extra precision makes the double
// rounding of `+ - * /` harmless.
macro_rules! half_num {
    ($($t:ty),*) => {$(
        impl Num for $t {
            const FLOAT: bool = true;
            const NARROW: bool = true;
            const ZERO: $t = <$t>::ZERO;
            const ONE: $t = <$t>::ONE;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            #[inline(always)]
            fn from_f64(v: f64) -> $t {
                <$t>::from_f32(f64_to_f32_odd(v))
            }
            #[inline(always)]
            fn add(self, o: $t) -> $t {
                <$t>::from_f32(self.to_f32() + o.to_f32())
            }
            #[inline(always)]
            fn sub(self, o: $t) -> $t {
                <$t>::from_f32(self.to_f32() - o.to_f32())
            }
            #[inline(always)]
            fn mul(self, o: $t) -> $t {
                <$t>::from_f32(self.to_f32() * o.to_f32())
            }
            #[inline(always)]
            fn div(self, o: $t) -> $t {
                <$t>::from_f32(self.to_f32() / o.to_f32())
            }
            #[inline(always)]
            fn neg(self) -> $t {
                -self
            }
            #[inline(always)]
            fn abs(self) -> $t {
                <$t>::from_bits(self.to_bits() & 0x7fff)
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            float_bit_ops!($t);
            #[inline(always)]
            fn maximum(self, o: $t) -> $t {
                <$t>::from_f32(Num::maximum(self.to_f32(), o.to_f32()))
            }
            #[inline(always)]
            fn minimum(self, o: $t) -> $t {
                <$t>::from_f32(Num::minimum(self.to_f32(), o.to_f32()))
            }
        }
    )*};
}
half_num!(f16, bf16);

/// `v` rounded to f32 toward the neighbour with an odd last bit when
/// inexact ("round to odd"). Rounding that result to nearest in a format at
/// least two bits narrower (f16, bf16) gives the correctly rounded value of
/// `v`, which `half`'s own `from_f64` does not: it drops the low 32 bits of
/// the f64 first, so a value just above a tie can round down.
#[inline(always)]
pub fn f64_to_f32_odd(v: f64) -> f32 {
    let r = v as f32;
    if !r.is_finite() || r as f64 == v {
        return r;
    }
    // The neighbour of `v` toward zero, then its odd neighbour pair member.
    let toward_zero = if (r as f64).abs() > v.abs() {
        f32::from_bits(r.to_bits() - 1)
    } else {
        r
    };
    f32::from_bits(toward_zero.to_bits() | 1)
}

// ---------------------------------------------------------------------------
// Scalar functions in f64, for the op definitions.

/// `e^x` for a result that will be rounded to f32 or narrower, within
/// 1e-15 relative of the exact value (2^-50, far below the 2^-44 that
/// rounding to f32 can tell apart), or an exact 0, infinity or NaN where
/// the f32 result is one. Branch-free, so the loops that call it
/// vectorize: softmax and `exp` over f32 spent most of their time in
/// calls to glibc's scalar `exp` (the MLP step's 128×10 log-softmax:
/// 10 µs).
///
/// `x` is first clamped to [-110, 90], past which every f32 result is 0 or
/// infinity anyway (NaN passes the clamp). Then `x = n·ln 2 + r` with
/// `|r| ≤ ln 2 / 2` (Cody–Waite: `n · LN2_HI` is exact), `e^r` is its
/// Taylor polynomial to degree 12 (truncation below 2e-16; evaluated by
/// Estrin's scheme), and `2^n` is built from its bits.
#[inline(always)]
pub fn exp_to_narrow(x: f64) -> f64 {
    // 1.5 · 2^52: adding it rounds to an integer (to nearest, even), which
    // then sits in the low bits of the sum's representation.
    const ROUNDER: f64 = 6_755_399_441_055_744.0;
    // ln 2 split so that `n · LN2_HI` is exact for |n| < 2^20.
    const LN2_HI: f64 = 6.931_471_803_691_238e-1;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    let x = x.clamp(-110.0, 90.0);
    let shifted = x * std::f64::consts::LOG2_E + ROUNDER;
    let n = shifted - ROUNDER;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // Estrin's scheme: pairs joined by r², r⁴, r⁸, a dependency chain of
    // four multiply-adds where Horner's is twelve, which left the loops
    // waiting on latency (tanh, and GELU and its derivative, run this per
    // element).
    let c = &INVERSE_FACTORIALS;
    let r2 = r * r;
    let r4 = r2 * r2;
    let pair = |k: usize| c[k] + c[k + 1] * r;
    let quad = |k: usize| pair(k) + pair(k + 2) * r2;
    let p = (quad(0) + quad(4) * r4) + (quad(8) + c[12] * r4) * (r4 * r4);
    // `shifted`'s low bits hold n (two's complement); n + 1023 in the
    // exponent field is 2^n, normal for the clamped range.
    let scale = f64::from_bits(shifted.to_bits().wrapping_add(1023) << 52);
    p * scale
}

/// 1/k! for k = 0..=12 (each k! is exact in f64, so each entry is
/// correctly rounded).
const INVERSE_FACTORIALS: [f64; 13] = {
    let mut inverse = [0.0; 13];
    let mut factorial = 1.0;
    let mut k = 0;
    while k < 13 {
        inverse[k] = 1.0 / factorial;
        k += 1;
        factorial *= k as f64;
    }
    inverse
};

/// Logistic sigmoid without overflow: `e^x` is only formed for `x < 0`,
/// where it is below 1.
#[inline(always)]
pub fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// [`sigmoid`] for a result rounded to f32 or narrower, with selects only
/// so that a loop over a slice vectorizes: `e^{-|x|}` from
/// [`exp_to_narrow`] (within 1e-15), then `1/(1 + e)` or `e/(1 + e)`.
/// Below x = -110, where the exponential is clamped, the exact result and
/// this one (1.7e-48) both round to 0 in every narrow type.
#[inline(always)]
pub fn sigmoid_to_narrow(x: f64) -> f64 {
    let e = exp_to_narrow(-x.abs());
    let numerator = if x >= 0.0 { 1.0 } else { e };
    numerator / (1.0 + e)
}

/// `x·σ(t)` for a result rounded to f32 or narrower, by
/// [`sigmoid_to_narrow`], vectorizable: SiLU (`t = x`) and the tanh GELU.
/// Below t = -120, x is negative in both uses and |x·e^t| < 1e-50, so the
/// exact result rounds to -0 in every narrow type, while the clamped
/// exponential would leave `x·1.7e-48`.
#[inline(always)]
fn times_sigmoid_to_narrow(x: f64, t: f64) -> f64 {
    let y = x * sigmoid_to_narrow(t);
    if t < -120.0 {
        -0.0
    } else {
        y
    }
}

/// [`silu`] for a result rounded to f32 or narrower: `x·σ(x)`,
/// vectorizable (see [`times_sigmoid_to_narrow`]).
#[inline(always)]
pub fn silu_to_narrow(x: f64) -> f64 {
    times_sigmoid_to_narrow(x, x)
}

/// `tanh` for a result rounded to f32 or narrower, with selects only so
/// that a loop over a slice vectorizes (libm's `tanh` is a branchy call:
/// 11–20 ns an element). Both forms are computed and one is kept:
/// - |x| ≥ 1/8: `(1 - e)/(1 + e)` with `e = e^{-2|x|}` from
///   [`exp_to_narrow`]; `1 - e ≥ 0.22` there, so `e`'s error (1e-15) is
///   magnified at most 3.5 times;
/// - |x| < 1/8: the Taylor series `x·(1 - x²/3 + 2x⁴/15 - ...)` to
///   `x¹⁵`, whose first dropped term is below 4e-16 of the result.
///
/// The error stays below 5e-15, inside the 2^-44 that the narrow types'
/// `0.5 + 2^-20` ulp bound leaves (`docs/accuracy.md`).
#[inline(always)]
pub fn tanh_to_narrow(x: f64) -> f64 {
    /// tanh(x)/x = Σ c_k x^{2k}: 1, -1/3, 2/15, -17/315, 62/2835,
    /// -1382/155925, 21844/6081075, -929569/638512875 (from the Bernoulli
    /// numbers), each rounded once.
    const SERIES: [f64; 8] = [
        1.0,
        -0.333_333_333_333_333_3,
        0.133_333_333_333_333_33,
        -0.053_968_253_968_253_97,
        0.021_869_488_536_155_203,
        -0.008_863_235_529_902_197,
        0.003_592_128_036_572_481,
        -0.001_455_834_387_051_318_3,
    ];
    let w = x * x;
    let mut q = SERIES[7];
    for &c in SERIES[..7].iter().rev() {
        q = q * w + c;
    }
    let near_zero = x * q;
    let e = exp_to_narrow(-2.0 * x.abs());
    let far = ((1.0 - e) / (1.0 + e)).copysign(x);
    if x.abs() < 0.125 {
        near_zero
    } else {
        far
    }
}

/// `x·σ(x)` (SiLU, swish), within 3.5 ulp in f64 (`docs/accuracy.md`).
/// For large negative `x` σ(x) ≈ e^x is never formed as `1 - something`.
/// Below x = -700 the result is `(x·h)·h` with `h = e^{x/2}`: e^x itself
/// is subnormal below -708.4 (up to 370 ulp off for x·e^x, which stays
/// normal down to -715), `h` is not, and `1 + e^x` is 1 there.
#[inline(always)]
pub fn silu(x: f64) -> f64 {
    if x == f64::NEG_INFINITY {
        // The limit; the formula would give -inf · 0 = NaN.
        return -0.0;
    }
    if x < -700.0 {
        let h = (0.5 * x).exp();
        return x * h * h;
    }
    x * sigmoid(x)
}

/// `ln(1 + e^x)` without overflow or cancellation: `max(x, 0) +
/// ln(1 + e^-|x|)`, whose second term is formed with `ln_1p` and is below
/// ln 2, so it never swamps the first.
#[inline(always)]
pub fn softplus(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// `1/√x`.
#[inline(always)]
pub fn rsqrt(x: f64) -> f64 {
    1.0 / x.sqrt()
}

/// `max(x, 0)`; NaN stays NaN.
#[inline(always)]
pub fn relu(x: f64) -> f64 {
    if x > 0.0 || x.is_nan() {
        x
    } else {
        0.0
    }
}

/// -1, 0 or 1 (±0 and NaN stay as they are).
#[inline(always)]
pub fn sign(x: f64) -> f64 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        x
    }
}

/// `1/√2 - FRAC_1_SQRT_2`: the rounding error of the f64 constant.
const FRAC_1_SQRT_2_LO: f64 = -4.833_646_656_726_457e-17;
/// `1/√(2π)`.
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// Exact GELU, `x·Φ(x)`, within 4 ulp in f64 (see `docs/accuracy.md`).
///
/// `Φ(x) = erfc(-x/√2)/2` is the same function as `(1 + erf(x/√2))/2` but
/// keeps its relative accuracy for large negative `x`, where `1 + erf`
/// cancels to 0. Two more things matter for negative `x` in f64:
/// - erfc magnifies the relative error of its argument by about `2z²`, so
///   the rounding error `δ` of `z = -x/√2` (up to 1,600 ulp of the result
///   near x = -37) is corrected: `erfc(z + δ) ≈ erfc(z) - δ·(2/√π)·e^{-z²}`;
/// - below x ≈ -36.8, erfc(z) is subnormal while the result is not yet, so
///   the result comes from the asymptotic series `-φ(x)·(1 - 1/x² + 3/x⁴
///   - ...)` with `e^{-x²/2}` evaluated from the exact square of `x`.
#[inline(always)]
pub fn gelu(x: f64) -> f64 {
    if x == f64::NEG_INFINITY {
        // The limit; the formula would give -inf · 0 = NaN.
        return -0.0;
    }
    let z = -x * std::f64::consts::FRAC_1_SQRT_2;
    if z <= 0.5 || z.is_nan() {
        // Small magnification: the rounded argument is good enough.
        return 0.5 * x * libm::erfc(z);
    }
    if z < 26.0 {
        // The exact -x/√2 minus the rounded z (the product's error by FMA,
        // plus the constant's own rounding error).
        let delta = (-x).mul_add(std::f64::consts::FRAC_1_SQRT_2, -z) + (-x) * FRAC_1_SQRT_2_LO;
        let slope = std::f64::consts::FRAC_2_SQRT_PI * (-z * z).exp();
        return 0.5 * x * (libm::erfc(z) - delta * slope);
    }
    if x < -39.0 {
        // |x·Φ(x)| < φ(39) < 1e-330: below half the smallest subnormal.
        return -0.0;
    }
    // -39 ≤ x < -36.7: 1/x² < 7.5e-4, and eight terms leave an error below
    // 2e-19.
    let r = 1.0 / (x * x);
    let series = 1.0
        - r * (1.0
            - 3.0
                * r
                * (1.0
                    - 5.0
                        * r
                        * (1.0 - 7.0 * r * (1.0 - 9.0 * r * (1.0 - 11.0 * r * (1.0 - 13.0 * r))))));
    // e^{-x²/2} = e^{-hi/2}·e^{-lo/2} with x² = hi + lo exactly; |lo| is
    // below 2^-42 here, so e^{-lo/2} = 1 - lo/2.
    let hi = x * x;
    let lo = x.mul_add(x, -hi);
    // The factor (about 0.4) first, so that the one multiplication into
    // the subnormal range rounds once.
    let factor = -FRAC_1_SQRT_2PI * series * (1.0 - 0.5 * lo);
    factor * (-0.5 * hi).exp()
}

/// [`gelu`] for `x` read from f32, f16 or bf16 and a result rounded to
/// one of them: the first value of [`gelu_with_derivative_to_narrow`]
/// (inlined, the derivative's few extra operations are dropped).
#[inline(always)]
pub fn gelu_to_narrow(x: f64) -> f64 {
    gelu_with_derivative_to_narrow(x).0
}

/// GELU and its derivative, `(x·Φ(x), Φ(x) + x·φ(x))`, for `x` read from
/// f32, f16 or bf16 and results rounded to one of them, with selects only
/// and no library call, so that a loop over a slice vectorizes (libm's
/// `erfc` is a branchy scalar call, and made f32 GELU about 50 times the
/// cost of an addition).
///
/// `erfc(z) = t·Q(t)·e^{-z²}` with `t = 2/(2 + z)`, `z = |x|/√2`, where
/// `Q` is smooth on `t ∈ [1/7, 1]` (z ≤ 12) and is a polynomial of degree
/// 19 ([`GELU_ERFC_SERIES`]). `z² = x²/2` is exact for a narrow `x`, so
/// `e^{-z²}` is [`exp_to_narrow`]'s (within 1e-15), and the same factor is
/// the Gaussian density `φ(x)` up to `1/√(2π)`: the derivative costs a
/// few operations more than GELU, where a separate pass over `x` (and
/// `y`) cost an exponential and a division per element. The relative
/// error of `erfc` stays near 5e-15, far inside the 2^-44 the narrow
/// types' `0.5 + 2^-20` ulp bound leaves (`docs/accuracy.md`). The
/// derivative is within 1e-15 of `max(Φ, |x|·φ)` absolutely: relatively
/// so except near its zero at x ≈ -0.75, where `Φ` and `x·φ` cancel.
/// Beyond |x| = 17 the results are `(x, 1)` or `(-0, 0)` in every narrow
/// type.
#[inline(always)]
pub fn gelu_with_derivative_to_narrow(x: f64) -> (f64, f64) {
    let z = (x.abs() * std::f64::consts::FRAC_1_SQRT_2).min(12.0);
    let t = 2.0 / (2.0 + z);
    // t ∈ [1/7, 1] mapped onto [-1, 1].
    let u = t * (7.0 / 3.0) - 4.0 / 3.0;
    // Estrin's scheme: pairs, then quads, ... joined by u², u⁴, u⁸, u¹⁶,
    // a dependency chain of 5 steps instead of Horner's 19, which left the
    // loop waiting on latency.
    let a = &GELU_ERFC_SERIES;
    let u2 = u * u;
    let u4 = u2 * u2;
    let u8 = u4 * u4;
    let pair = |k: usize| a[k] + a[k + 1] * u;
    let quad = |k: usize| pair(k) + pair(k + 2) * u2;
    let oct = |k: usize| quad(k) + quad(k + 4) * u4;
    let q = oct(0) + oct(8) * u8 + quad(16) * (u8 * u8);
    // e^{-x²/2}; past x²/2 = 110 the exponential holds at e^{-110}, and
    // both results are settled by the selects below.
    let gaussian = exp_to_narrow(-0.5 * (x * x));
    let half_erfc = 0.5 * ((t * q) * gaussian);
    // Φ(x) is erfc(z)/2 below 0 and 1 - erfc(z)/2 above.
    let tail = x * half_erfc;
    let x_density = x * (FRAC_1_SQRT_2PI * gaussian);
    if x < -17.0 {
        // Also -inf, where the formulas would give -inf·0.
        (-0.0, 0.0)
    } else if x > 17.0 {
        (x, 1.0)
    } else if x <= 0.0 {
        // Zeros too: x - tail would make -0 a +0.
        (tail, half_erfc + x_density)
    } else {
        (x - tail, (1.0 - half_erfc) + x_density)
    }
}

/// The coefficients, lowest degree first, of the polynomial in
/// `u = (7t - 4)/3` that [`gelu_with_derivative_to_narrow`] takes for
/// `Q(t) = erfc(z)·e^{z²}/t`, `z = 2/t - 2`: its Chebyshev series of
/// degree 19 (interpolation at 160 Chebyshev nodes in 60-digit
/// arithmetic, error 1.0e-15 on [-1, 1], where `Q ≥ 0.28`) rewritten in
/// powers of `u`. The sum of their magnitudes is 1.02, so the power form
/// loses nothing to cancellation. `scripts/gelu_erfc_series.py` computes
/// them.
const GELU_ERFC_SERIES: [f64; 20] = [
    0.5627744787950565,
    0.32956191923766215,
    0.10737093007837145,
    0.0072477585388619195,
    -0.006781316964496918,
    -0.000828005837584414,
    0.0007043371942766528,
    1.6876775419210594e-05,
    -8.657718989919078e-05,
    1.5522461558057767e-05,
    7.922044037447643e-06,
    -4.445727732019373e-06,
    2.2300398582724052e-07,
    6.166801916103562e-07,
    -2.7184766313495663e-07,
    -6.736550271766744e-10,
    5.248514044638338e-08,
    -1.765739870585971e-08,
    -4.046680262140376e-09,
    2.6505493883683073e-09,
];

/// GELU's derivative `Φ(x) + x·φ(x)` given `y = gelu(x)`: `Φ(x)` is read
/// back as `y/x` (1/2 at 0), which keeps its relative accuracy where `Φ`
/// is tiny (`1 + erf` cancels there) and costs no second `erfc`. f32, f16
/// and bf16 use [`gelu_derivative_to_narrow`].
#[inline(always)]
pub fn gelu_derivative(x: f64, y: f64) -> f64 {
    if x.is_infinite() {
        return if x > 0.0 { 1.0 } else { 0.0 };
    }
    let cdf = if x == 0.0 { 0.5 } else { y / x };
    // e^{-x²/2} from the exact square x² = hi + lo (|lo| ≤ ulp(hi)/2, so
    // e^{-lo/2} = 1 - lo/2 to f64 precision wherever the result is normal).
    let hi = x * x;
    let lo = x.mul_add(x, -hi);
    let pdf = FRAC_1_SQRT_2PI * (-0.5 * hi).exp() * (1.0 - 0.5 * lo);
    cdf + x * pdf
}

/// [`gelu_derivative`] for `x` read from f32, f16 or bf16 and a result
/// rounded to one of them, with selects only and no library call, so that
/// a loop over a slice vectorizes: `x²` is exact in f64 for such an `x`,
/// and `e^{-x²/2}` comes from [`exp_to_narrow`] (within 1e-15).
#[inline(always)]
pub fn gelu_derivative_to_narrow(x: f64, y: f64) -> f64 {
    let half_sq = 0.5 * (x * x);
    // Beyond x²/2 = 110, x·φ(x) is below 1e-47, a zero in every narrow
    // type; infinite x would make it ±inf·0.
    let x_pdf = if half_sq > 110.0 {
        0.0
    } else {
        x * (FRAC_1_SQRT_2PI * exp_to_narrow(-half_sq))
    };
    let cdf = if x == 0.0 {
        0.5
    } else if half_sq > 110.0 {
        // y/x is inf/inf at the infinities; Φ is 0 or 1 to f64 precision.
        if x > 0.0 {
            1.0
        } else {
            0.0
        }
    } else {
        y / x
    };
    cdf + x_pdf
}

/// GELU's tanh approximation, `x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))/2`,
/// the form GPT-2 and BERT were trained with, within 4 ulp in f64
/// (`docs/accuracy.md`). Written as `x·σ(t)` with `t = 2u` (the same
/// function: `(1 + tanh u)/2 = σ(2u)`), which does not cancel for negative
/// `x`.
///
/// For negative `x` the result is about `x·e^t`, whose relative error is
/// `|t|` times that of `t`, and `|t|` reaches 745 before the result
/// underflows: `t` rounded once per operation put f64 results up to 1,500
/// ulp off near x = -20. So `t = 2√(2/π)·x·(1 + 0.044715·x²)` is formed as
/// an unevaluated sum `t + t_lo` (FMA products, the constants' rounding
/// errors included; 0.044715 is the decimal, as in the papers), and
/// `e^{t + t_lo} = e^t·(1 + t_lo)`. Below t = -700, `e^t` would be
/// subnormal while the result is not yet, so `e^{t/2}` is squared instead.
/// `x` is clamped to ±30 for `t` (beyond, σ(t) is 0 or 1 in f64 and the
/// cube would overflow). f32, f16 and bf16 use [`gelu_tanh_to_narrow`].
#[inline(always)]
pub fn gelu_tanh(x: f64) -> f64 {
    /// 2√(2/π) = C_HI + C_LO.
    const C_HI: f64 = 1.595_769_121_605_730_8;
    const C_LO: f64 = -9.969_308_809_110_92e-17;
    /// The decimal 0.044715 = K_HI + K_LO.
    const K_HI: f64 = 0.044_715;
    const K_LO: f64 = 2.196_021_142_708_559_5e-18;
    if x == f64::NEG_INFINITY {
        return -0.0;
    }
    let a = x.clamp(-30.0, 30.0);
    // a² = a2 + a2_lo, K·a² = p + p_lo.
    let a2 = a * a;
    let a2_lo = a.mul_add(a, -a2);
    let p = K_HI * a2;
    let p_lo = K_HI.mul_add(a2, -p) + (K_HI * a2_lo + K_LO * a2);
    // 1 + K·a² = q + q_lo (two-sum: p may exceed 1).
    let q = 1.0 + p;
    let pp = q - 1.0;
    let q_lo = ((1.0 - (q - pp)) + (p - pp)) + p_lo;
    // a·(1 + K·a²) = r + r_lo, then t + t_lo = C·(r + r_lo).
    let r = a * q;
    let r_lo = a.mul_add(q, -r) + a * q_lo;
    let t = C_HI * r;
    let t_lo = C_HI.mul_add(r, -t) + (C_HI * r_lo + C_LO * r);
    if t >= 0.0 {
        // x·σ(t) = x/(1 + e^{-t}).
        let e0 = (-t).exp();
        let e = e0.mul_add(-t_lo, e0);
        x / (1.0 + e)
    } else if t > -700.0 {
        // x·σ(t) = x·e^t/(1 + e^t).
        let e0 = t.exp();
        let e = e0.mul_add(t_lo, e0);
        x * e / (1.0 + e)
    } else {
        // 1 + e^t = 1; e^t = h² with h normal (or NaN through).
        let h0 = (0.5 * t).exp();
        let h = h0.mul_add(0.5 * t_lo, h0);
        x * h * h
    }
}

/// [`gelu_tanh`] for a result that will be rounded to f32 or narrower,
/// without the f64 form's FMA corrections (library calls where FMA is not
/// a target feature): `t` rounded once per operation. Where an f32 result
/// is normal, `|t| < 90`, and this stays within about 2^-21 of an f32 ulp
/// of the exact value (sampled; f16 and bf16 have wider ulps), inside the
/// 2^-20 the accuracy suite allows for rounding an f64 value to a narrow
/// type (`docs/accuracy.md`). σ comes from [`sigmoid_to_narrow`], so the
/// loop vectorizes. Below t = -120 (x < -11.4, and -inf) the exact result
/// rounds to -0 in every narrow type, and the clamped exponential would
/// not give it.
#[inline(always)]
pub fn gelu_tanh_to_narrow(x: f64) -> f64 {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    let t = 2.0 * (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x));
    times_sigmoid_to_narrow(x, t)
}

/// The error function.
#[inline(always)]
pub fn erf(x: f64) -> f64 {
    libm::erf(x)
}

/// `e^x - 1`, accurate near 0.
#[inline(always)]
pub fn expm1(x: f64) -> f64 {
    x.exp_m1()
}

/// `ln(1 + x)`, accurate near 0.
#[inline(always)]
pub fn log1p(x: f64) -> f64 {
    x.ln_1p()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorizable narrow GELU against the f64 one (within 4 ulp of
    /// exact) on f32 inputs across its whole range: well inside the 2^-44
    /// relative error a correctly rounded f32 allows; and its limits.
    #[test]
    fn gelu_to_narrow_matches_the_wide_form() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = f64::from(-14.0f32 + 31.0 * i as f32 / 200_000.0);
            let (got, want) = (gelu_to_narrow(x), gelu(x));
            if want != 0.0 {
                worst = worst.max(((got - want) / want).abs());
            }
        }
        assert!(worst < 2e-14, "relative error {worst:e}");
        for x in [1e-30, -1e-30, 1e-45, 0.5, -0.5] {
            let rel = ((gelu_to_narrow(x) - gelu(x)) / gelu(x)).abs();
            assert!(rel < 2e-14, "gelu({x:e}): {rel:e}");
        }
        assert_eq!(gelu_to_narrow(f64::INFINITY), f64::INFINITY);
        assert_eq!(
            gelu_to_narrow(f64::NEG_INFINITY).to_bits(),
            (-0.0f64).to_bits()
        );
        assert_eq!(gelu_to_narrow(-20.0).to_bits(), (-0.0f64).to_bits());
        assert_eq!(gelu_to_narrow(-0.0).to_bits(), (-0.0f64).to_bits());
        assert_eq!(gelu_to_narrow(20.0), 20.0);
        assert!(gelu_to_narrow(f64::NAN).is_nan());
    }

    /// The vectorizable narrow tanh against libm's on f32 inputs (both
    /// forms and the switch between them), and its limits.
    #[test]
    fn tanh_to_narrow_matches_libm() {
        for i in 0..=200_000 {
            let x = f64::from(-3.0f32 + 6.0 * i as f32 / 200_000.0);
            let want = x.tanh();
            if want != 0.0 {
                let rel = ((tanh_to_narrow(x) - want) / want).abs();
                assert!(rel < 5e-15, "tanh({x}): {rel:e}");
            }
        }
        for x in [1e-30, -1e-30, 1e-45, 0.124_999_99, 0.125, 20.0, -20.0] {
            let rel = ((tanh_to_narrow(x) - x.tanh()) / x.tanh()).abs();
            assert!(rel < 5e-15, "tanh({x:e}): {rel:e}");
        }
        assert_eq!(tanh_to_narrow(f64::INFINITY), 1.0);
        assert_eq!(tanh_to_narrow(f64::NEG_INFINITY), -1.0);
        assert_eq!(tanh_to_narrow(-0.0).to_bits(), (-0.0f64).to_bits());
        assert_eq!(tanh_to_narrow(1e30), 1.0);
        assert!(tanh_to_narrow(f64::NAN).is_nan());
    }

    /// The vectorizable narrow sigmoid, SiLU and tanh GELU against their
    /// f64 forms on f32 inputs, and their limits.
    #[test]
    fn narrow_sigmoid_forms_match_the_wide_ones() {
        let rel = |a: f64, b: f64| {
            if b == 0.0 {
                a.abs()
            } else {
                ((a - b) / b).abs()
            }
        };
        for i in 0..=100_000 {
            let x = f64::from(-100.0f32 + 200.0 * i as f32 / 100_000.0);
            assert!(
                rel(sigmoid_to_narrow(x), sigmoid(x)) < 4e-15,
                "sigmoid({x})"
            );
            assert!(rel(silu_to_narrow(x), silu(x)) < 4e-15, "silu({x})");
            if x > -10.0 {
                let (got, want) = (gelu_tanh_to_narrow(x), gelu_tanh(x));
                assert!(rel(got, want) < 2e-13 * (1.0 + x * x), "gelu_tanh({x})");
            }
        }
        assert_eq!(sigmoid_to_narrow(f64::INFINITY), 1.0);
        assert!(sigmoid_to_narrow(f64::NEG_INFINITY) < 1e-47);
        for f in [silu_to_narrow, gelu_tanh_to_narrow] {
            assert_eq!(f(f64::INFINITY), f64::INFINITY);
            assert_eq!(f(f64::NEG_INFINITY).to_bits(), (-0.0f64).to_bits());
            assert_eq!(f(-1e30).to_bits(), (-0.0f64).to_bits());
            assert_eq!(f(-0.0).to_bits(), (-0.0f64).to_bits());
            assert!(f(f64::NAN).is_nan());
        }
        assert!(sigmoid_to_narrow(f64::NAN).is_nan());
    }

    /// GELU's derivative, narrow and wide, against `Φ(x) + xφ(x)` from
    /// libm's erfc, and at the specials.
    #[test]
    fn gelu_derivative_forms() {
        for i in -1600..=1600 {
            let x = (i as f64 / 100.0) as f32 as f64;
            let cdf = 0.5 * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2);
            let x_pdf = x * (-0.5 * x * x).exp() * FRAC_1_SQRT_2PI;
            let want = cdf + x_pdf;
            // Φ + xφ cancels near its root (x ≈ -0.75): errors are
            // measured against the size of its terms.
            let scale = cdf.abs() + x_pdf.abs();
            let y = gelu(x);
            let narrow_y = y as f32 as f64;
            for (name, got, tolerance) in [
                ("wide", gelu_derivative(x, y), 1e-14),
                // Φ = y/x inherits y's f32 rounding.
                ("narrow", gelu_derivative_to_narrow(x, narrow_y), 2e-7),
                // Φ from the same erfc as GELU, no rounded y in between.
                ("with GELU", gelu_with_derivative_to_narrow(x).1, 4e-15),
            ] {
                assert!(
                    // (1.4e-46: a tenth of the smallest f32 subnormal.)
                    (got - want).abs() <= tolerance * scale + 1.4e-46,
                    "{name} gelu'({x:e}): {got:e} vs {want:e}"
                );
            }
        }
        for (x, d) in [
            (f64::INFINITY, 1.0),
            (f64::NEG_INFINITY, 0.0),
            (0.0, 0.5),
            (-0.0, 0.5),
            (-1e30, 0.0),
            (1e30, 1.0),
        ] {
            let y = gelu(x);
            assert_eq!(gelu_derivative(x, y), d, "gelu'({x})");
            assert_eq!(gelu_derivative_to_narrow(x, y), d, "narrow gelu'({x})");
            let (narrow_y, narrow_d) = gelu_with_derivative_to_narrow(x);
            assert_eq!(narrow_d as f32, d as f32, "gelu'({x}) with GELU");
            assert_eq!(narrow_y.to_bits(), gelu_to_narrow(x).to_bits(), "gelu({x})");
        }
        let (y, d) = gelu_with_derivative_to_narrow(f64::NAN);
        assert!(y.is_nan() && d.is_nan());
        assert!(gelu_derivative_to_narrow(f64::NAN, f64::NAN).is_nan());
        assert!(gelu_derivative(f64::NAN, f64::NAN).is_nan());
    }

    #[test]
    fn bitwise_and_shifts() {
        assert_eq!(Num::bit_and(0b1100u8, 0b1010), 0b1000);
        assert_eq!(Num::bit_or(0b1100u16, 0b1010), 0b1110);
        assert_eq!(Num::bit_xor(-1i16, 5), -6);
        assert_eq!(Num::bit_not(0u64), u64::MAX);
        assert_eq!(Num::bit_not(5i32), -6);
        assert_eq!(Num::shift_left(1u8, 7), 128);
        assert_eq!(Num::shift_left(1u8, 8), 0);
        assert_eq!(Num::shift_left(3u32, 31), 1 << 31);
        assert_eq!(Num::shift_left(1i64, -1), 0);
        assert_eq!(Num::shift_right(0x80u8, 7), 1);
        assert_eq!(Num::shift_right(u64::MAX, 64), 0);
        assert_eq!(Num::shift_right(-8i8, 1), -4);
        assert_eq!(Num::shift_right(-8i8, 100), -1);
        assert_eq!(Num::shift_right(8i16, 16), 0);
        assert_eq!(Num::shift_right(i32::MIN, 31), -1);
        // Floats are outside the bitwise ops' class: their first operand.
        assert_eq!(Num::bit_and(1.5f32, 2.0), 1.5);
    }

    #[test]
    fn integers_wrap_and_floats_round() {
        assert_eq!(Num::add(i8::MAX, 1), i8::MIN);
        assert_eq!(Num::neg(i32::MIN), i32::MIN);
        assert_eq!(Num::abs(i8::MIN), i8::MIN);
        assert_eq!(Num::neg(3u8), 253);
        assert_eq!(Num::div(7i32, 0), 7);
        assert_eq!(Num::div(i64::MIN, -1), i64::MIN);
        assert_eq!(<u8 as Num>::from_f64(300.0), 255);
        assert_eq!(<i8 as Num>::from_f64(f64::NAN), 0);
        assert_eq!(<f32 as Num>::from_f64(0.1), 0.1f32);
        assert!(Num::maximum(f32::NAN, 1.0).is_nan());
        assert!(Num::minimum(1.0, f64::NAN).is_nan());
        assert_eq!(Num::abs(f16::from_f32(-2.0)), f16::from_f32(2.0));
    }

    /// The vectorizing `exp` for narrow results is within 1e-15 of glibc's
    /// over the whole range where an f32 result is neither 0 nor infinite,
    /// and gives the exact special values past it (`tests/accuracy.rs`
    /// measures the rounded f32, f16 and bf16 results against a
    /// double-double reference).
    #[test]
    fn exp_for_narrow_results_matches_glibc() {
        let steps = 2_000_000;
        for i in 0..=steps {
            let x = -110.0 + 200.0 * i as f64 / steps as f64;
            let (got, want) = (exp_to_narrow(x), x.exp());
            let rel = ((got - want) / want).abs();
            assert!(rel < 1e-15, "exp({x}) = {got:e}, glibc {want:e}");
        }
        assert_eq!(exp_to_narrow(0.0), 1.0);
        assert_eq!(exp_to_narrow(-0.0), 1.0);
        assert!(exp_to_narrow(f64::NAN).is_nan());
        assert_eq!(exp_to_narrow(f64::NEG_INFINITY) as f32, 0.0);
        assert_eq!(exp_to_narrow(-1e300) as f32, 0.0);
        assert_eq!(exp_to_narrow(f64::INFINITY) as f32, f32::INFINITY);
        assert_eq!(exp_to_narrow(1e300) as f32, f32::INFINITY);
        // The f32 overflow threshold and the smallest subnormal round as
        // glibc's value does.
        for x in [88.72283, 88.72284, -103.27893, -103.972_08, -87.33655] {
            assert_eq!(exp_to_narrow(x) as f32, x.exp() as f32, "exp({x})");
        }
    }

    #[test]
    fn gelu_tail_constants_and_branches() {
        // (C + lo)² = 1/2 to double-double precision.
        let c = std::f64::consts::FRAC_1_SQRT_2;
        let lo = -c.mul_add(c, -0.5) / (2.0 * c);
        assert!((lo - FRAC_1_SQRT_2_LO).abs() < 1e-31, "{lo:e}");
        assert_eq!(FRAC_1_SQRT_2PI, 1.0 / (2.0 * std::f64::consts::PI).sqrt());
        // The branches meet smoothly: neighbours across each switch differ
        // by the function's own slope, not by a jump. (tests/accuracy.rs
        // measures the error against a double-double reference.)
        for switch in [
            -0.5 * std::f64::consts::SQRT_2,
            -26.0 * std::f64::consts::SQRT_2,
        ] {
            let (a, b) = (gelu(switch * (1.0 + 1e-12)), gelu(switch * (1.0 - 1e-12)));
            let rel = (a - b).abs() / a.abs();
            assert!(rel < 1e-8, "gelu jumps at {switch}: {a:e} vs {b:e}");
        }
        // The tail is still x·Φ(x) ≈ -φ(x)/1.0007... near x = -38.
        let x: f64 = -38.0;
        let phi = (-x * x / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
        assert!((gelu(x) / -phi - (1.0 - 1.0 / (x * x))).abs() < 1e-5);
    }

    #[test]
    fn stable_forms_match_the_textbook_away_from_their_hazards() {
        for x in [-3.0, -0.5, 0.0, 0.25, 2.0, 10.0] {
            let naive = (1.0 + f64::exp(x)).ln();
            assert!((softplus(x) - naive).abs() <= 1e-15 * naive.abs().max(1.0));
            let naive = x / (1.0 + (-x).exp());
            assert!((silu(x) - naive).abs() <= 1e-15 * naive.abs().max(1.0));
            let t = 0.797_884_560_802_865_4 * (x + 0.044_715 * x * x * x);
            let naive = 0.5 * x * (1.0 + f64::tanh(t));
            assert!((gelu_tanh(x) - naive).abs() <= 1e-15 * naive.abs().max(1.0));
        }
        // Where the textbook forms overflow or cancel.
        assert_eq!(softplus(1000.0), 1000.0);
        assert!(softplus(-800.0) >= 0.0);
        assert_eq!(silu(-1000.0), -0.0);
        assert!(gelu_tanh(-30.0) <= 0.0 && gelu_tanh(-30.0) > -1e-300);
        assert!(softplus(f64::NAN).is_nan());
    }
}
