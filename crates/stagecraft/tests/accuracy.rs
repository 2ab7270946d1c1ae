//! Accuracy of the elementwise transcendental functions (issue 9, point 7).
//!
//! Every float unary op of the public API that is not exact by construction
//! (`exp`, `log`, `sqrt`, `rsqrt`, `tanh`, `sigmoid`, `gelu`, `sin`, `cos`,
//! `erf`, `gelu_tanh`, `silu`, `softplus`, `log1p`, `expm1`, and the single
//! roundings `reciprocal` and `square`) and the binary `pow` are run
//! through the CPU kernels (eager `cpu:0`) on dense sweeps of inputs for
//! f32, f64, f16 and bf16 and compared with a reference computed here in
//! double-double arithmetic (about 106 bits; see [`dd`]), independently
//! of the kernels' f64/libm path. The error of a result is
//! `|got - exact| / ulp(exact)` in the result's own type (the ulp of the
//! exact value's binade, subnormal ulps below the normal range), as a real
//! number: 0.5 means correctly rounded.
//!
//! Inputs per dtype:
//! - f16, bf16: every bit pattern (exhaustive); `pow`: every positive finite
//!   base against a set of exponents, plus negative bases with integer
//!   exponents.
//! - f32: 2^20 bit patterns evenly strided over all 2^32, plus 2^19 strided
//!   over each function's interesting ranges (both signs), plus the 8,192
//!   consecutive values around each critical point (0, 1, overflow and
//!   underflow thresholds, multiples of pi/2, ...).
//! - f64: the same with 2^18 + 2^18 + 8,192.
//! - Special values for every dtype: ±0 (and the sign of a zero result),
//!   ±inf, NaN, the largest finite value, the smallest subnormal, checked
//!   for the exact IEEE/C99 result.
//!
//! `sin`/`cos` are measured for |x| < 2^28 (the reference's argument
//! reduction is exact there); beyond that (f32 and f64 only) results are
//! only checked to lie in [-1, 1]. `pow` is measured for finite positive
//! bases and for negative bases with integer exponents.
//!
//! Bounds asserted (max ulp error over all inputs of a dtype) and the
//! maxima measured when this suite was written (also in
//! `docs/accuracy.md`). f32, f16 and bf16 are computed in f64 and rounded
//! once, so they are asserted correctly rounded up to `0.5 + 2^-20` ulp
//! (only a result within 2^-20 ulp of a tie may round the other way);
//! measured maxima there are 0.5 to six digits for every function.
//!
//! | function   | f32, f16, bf16 bound | f64 bound | f64 measured |
//! |------------|----------------------|-----------|--------------|
//! | exp        | 0.5 + 2^-20          | 1.0       | 0.5044       |
//! | log        | 0.5 + 2^-20          | 1.0       | 0.5112       |
//! | sqrt       | 0.5 + 2^-20          | 0.5       | 0.5000       |
//! | rsqrt      | 0.5 + 2^-20          | 1.5       | 1.4749       |
//! | tanh       | 0.5 + 2^-20          | 2.5       | 2.0097       |
//! | sigmoid    | 0.5 + 2^-20          | 2.5       | 2.1887       |
//! | gelu       | 0.5 + 2^-20          | 4.0       | 3.4360       |
//! | sin        | 0.5 + 2^-20          | 1.0       | 0.5148       |
//! | cos        | 0.5 + 2^-20          | 1.0       | 0.5607       |
//! | pow        | 0.5 + 2^-20          | 1.0       | 0.5039       |
//! | erf        | 0.5 + 2^-20          | 1.5       | 0.9626       |
//! | gelu_tanh  | 0.5 + 2^-20          | 4.0       | 3.1703       |
//! | silu       | 0.5 + 2^-20          | 3.5       | 2.9244       |
//! | softplus   | 0.5 + 2^-20          | 2.0       | 1.4739       |
//! | log1p      | 0.5 + 2^-20          | 1.0       | 0.7870       |
//! | expm1      | 0.5 + 2^-20          | 1.0       | 0.7862       |
//! | reciprocal | 0.5 + 2^-20          | 0.5       | 0.5000       |
//! | square     | 0.5 + 2^-20          | 0.5       | 0.5000       |
//!
//! `gelu_tanh` is measured against the exact value of its own formula
//! (with √(2/π) and the decimal 0.044715 exact), not against `gelu`.
//! `elu` is not measured: it is composed of `expm1`, a multiplication by
//! `alpha` and `maximum`/`minimum`.
//!
//! Every special value must give its exact IEEE/C99 result (0 ulp).

use stagecraft::{bf16, f16, Device, FloatElement, Tensor};

// ---------------------------------------------------------------------------
// The reference: double-double arithmetic.

mod dd {
    //! Double-double numbers `hi + lo` (|lo| ≤ ulp(hi)/2), about 106 bits,
    //! with the error-free transformations `two_sum` and `two_prod` (FMA).

    use std::sync::OnceLock;

    #[derive(Clone, Copy, Debug, PartialEq)]
    pub struct Dd {
        pub hi: f64,
        pub lo: f64,
    }

    pub fn two_sum(a: f64, b: f64) -> Dd {
        let s = a + b;
        let bb = s - a;
        Dd {
            hi: s,
            lo: (a - (s - bb)) + (b - bb),
        }
    }

    fn fast_two_sum(a: f64, b: f64) -> Dd {
        let s = a + b;
        Dd {
            hi: s,
            lo: b - (s - a),
        }
    }

    pub fn two_prod(a: f64, b: f64) -> Dd {
        let p = a * b;
        Dd {
            hi: p,
            lo: a.mul_add(b, -p),
        }
    }

    /// `2^n` for any n (zero or infinity beyond the range).
    pub fn pow2(n: i32) -> f64 {
        let mut x = 1.0f64;
        let mut n = n;
        while n > 1000 {
            x *= f64::from_bits((1000u64 + 1023) << 52);
            n -= 1000;
        }
        while n < -1000 {
            x *= f64::from_bits((1023u64 - 1000) << 52);
            n += 1000;
        }
        x * f64::from_bits(((n + 1023) as u64) << 52)
    }

    /// `x·2^n` rounded once where the result is in range.
    pub fn ldexp(x: f64, n: i32) -> f64 {
        let mut x = x;
        let mut n = n;
        while n > 1000 {
            x *= pow2(1000);
            n -= 1000;
        }
        while n < -1000 {
            x *= pow2(-1000);
            n += 1000;
        }
        x * pow2(n)
    }

    /// The binary exponent of a finite non-zero `x` (`floor(log2|x|)`).
    pub fn ilogb(x: f64) -> i32 {
        let e = ((x.to_bits() >> 52) & 0x7ff) as i32;
        if e == 0 {
            ilogb(x * pow2(64)) - 64
        } else {
            e - 1023
        }
    }

    impl Dd {
        pub const ZERO: Dd = Dd { hi: 0.0, lo: 0.0 };
        pub const ONE: Dd = Dd { hi: 1.0, lo: 0.0 };

        pub fn new(x: f64) -> Dd {
            Dd { hi: x, lo: 0.0 }
        }
        pub fn add(self, o: Dd) -> Dd {
            let s = two_sum(self.hi, o.hi);
            let t = two_sum(self.lo, o.lo);
            let s = fast_two_sum(s.hi, s.lo + t.hi);
            fast_two_sum(s.hi, s.lo + t.lo)
        }
        pub fn neg(self) -> Dd {
            Dd {
                hi: -self.hi,
                lo: -self.lo,
            }
        }
        pub fn sub(self, o: Dd) -> Dd {
            self.add(o.neg())
        }
        pub fn mul(self, o: Dd) -> Dd {
            let p = two_prod(self.hi, o.hi);
            fast_two_sum(p.hi, p.lo + (self.hi * o.lo + self.lo * o.hi))
        }
        pub fn div(self, o: Dd) -> Dd {
            let q1 = self.hi / o.hi;
            let r = self.sub(o.mul(Dd::new(q1)));
            let q2 = r.hi / o.hi;
            let r = r.sub(o.mul(Dd::new(q2)));
            let q3 = r.hi / o.hi;
            fast_two_sum(q1, q2).add(Dd::new(q3))
        }
        /// Multiplication by a power of two (exact in range).
        pub fn scale(self, n: i32) -> Dd {
            Dd {
                hi: ldexp(self.hi, n),
                lo: ldexp(self.lo, n),
            }
        }
        pub fn sqrt(self) -> Dd {
            // Bring into [1, 4) so that the residual is exact.
            let e = ilogb(self.hi) & !1;
            let x = self.scale(-e);
            let s = x.hi.sqrt();
            let r = x.sub(two_prod(s, s));
            fast_two_sum(s, r.hi / (2.0 * s)).scale(e / 2)
        }
    }

    /// Σ s^(2n+1)/(2n+1) (atanh) or, alternating, atan; |s| < 1/2.
    fn odd_series(s: Dd, alternate: bool) -> Dd {
        let s2 = s.mul(s);
        let mut power = s;
        let mut sum = s;
        let mut n = 1.0;
        loop {
            power = power.mul(s2);
            if alternate {
                power = power.neg();
            }
            let term = power.div(Dd::new(2.0 * n + 1.0));
            sum = sum.add(term);
            if term.hi.abs() < sum.hi.abs() * 1e-34 {
                return sum;
            }
            n += 1.0;
        }
    }

    pub struct Consts {
        pub ln2: Dd,
        pub pi: Dd,
        pub frac_1_sqrt_2: Dd,
        pub frac_2_sqrt_pi: Dd,
        pub frac_1_sqrt_pi: Dd,
        /// 2√(2/π) = √(8/π), the slope of gelu_tanh's sigmoid argument.
        pub sqrt_8_over_pi: Dd,
        /// The decimal 0.044715 of gelu_tanh's cubic term (not its f64
        /// rounding).
        pub gelu_tanh_k: Dd,
        /// pi/2 as a sum of 17 doubles of at most 16 significant bits each
        /// (from the hexadecimal digits of pi), so `k·part` is exact for
        /// |k| < 2^37.
        pub pio2_parts: Vec<f64>,
    }

    /// The first 256 bits of the fraction of pi (hexadecimal digits).
    const PI_FRACTION_WORDS: [u32; 8] = [
        0x243F_6A88,
        0x85A3_08D3,
        0x1319_8A2E,
        0x0370_7344,
        0xA409_3822,
        0x299F_31D0,
        0x082E_FA98,
        0xEC4E_6C89,
    ];

    pub fn consts() -> &'static Consts {
        static C: OnceLock<Consts> = OnceLock::new();
        C.get_or_init(|| {
            // ln 2 = 2 atanh(1/3); pi = 16 atan(1/5) - 4 atan(1/239) (Machin).
            let third = Dd::ONE.div(Dd::new(3.0));
            let ln2 = odd_series(third, false).scale(1);
            let a5 = odd_series(Dd::ONE.div(Dd::new(5.0)), true);
            let a239 = odd_series(Dd::ONE.div(Dd::new(239.0)), true);
            let pi = a5.scale(4).sub(a239.scale(2));
            let sqrt_pi = pi.sqrt();
            let mut pio2_parts = vec![1.5];
            for (j, w) in PI_FRACTION_WORDS.iter().enumerate() {
                let j = j as i32;
                pio2_parts.push(ldexp((w >> 16) as f64, -(32 * j + 16 + 1)));
                pio2_parts.push(ldexp((w & 0xffff) as f64, -(32 * (j + 1) + 1)));
            }
            Consts {
                ln2,
                pi,
                frac_1_sqrt_2: Dd::new(0.5).sqrt(),
                frac_2_sqrt_pi: Dd::new(2.0).div(sqrt_pi),
                frac_1_sqrt_pi: Dd::ONE.div(sqrt_pi),
                sqrt_8_over_pi: Dd::new(8.0).div(pi).sqrt(),
                gelu_tanh_k: Dd::new(44_715.0).div(Dd::new(1e6)),
                pio2_parts,
            }
        })
    }

    /// `e^y - 1` for |y| ≤ 2, with full relative accuracy near 0:
    /// Taylor at y/2^12, then `p ← p(2 + p)` twelve times.
    pub fn expm1(y: Dd) -> Dd {
        let s = y.scale(-12);
        let mut term = s;
        let mut sum = s;
        let mut n = 2.0;
        loop {
            term = term.mul(s).div(Dd::new(n));
            sum = sum.add(term);
            if term.hi.abs() <= sum.hi.abs() * 1e-36 || term.hi == 0.0 {
                break;
            }
            n += 1.0;
        }
        for _ in 0..12 {
            sum = sum.mul(sum.add(Dd::new(2.0)));
        }
        sum
    }

    /// `e^x` as `(m, k)` with value `m·2^k`, m in about [0.7, 1.5]; any
    /// |x| below 2^40 (no overflow or underflow inside).
    pub fn exp(x: Dd) -> (Dd, i32) {
        assert!(x.hi.abs() < 1e12, "exp reference outside its range: {x:?}");
        let c = consts();
        let k = (x.hi / std::f64::consts::LN_2).round();
        let r = x.sub(c.ln2.mul(Dd::new(k)));
        (Dd::ONE.add(expm1(r)), k as i32)
    }

    /// ln x for finite x > 0: x = m·2^e with m in [√½, √2), then
    /// ln m = 2 atanh((m-1)/(m+1)) (no cancellation near 1).
    pub fn ln(x: f64) -> Dd {
        let mut e = ilogb(x);
        let mut m = ldexp(x, -e);
        if m > std::f64::consts::SQRT_2 {
            m /= 2.0;
            e += 1;
        }
        let s = Dd::new(m - 1.0).div(two_sum(m, 1.0));
        let ln_m = if s.hi == 0.0 {
            Dd::ZERO
        } else {
            odd_series(s, false).scale(1)
        };
        consts().ln2.mul(Dd::new(e as f64)).add(ln_m)
    }

    /// x - k·π/2 exactly (an expansion of doubles, summed at the end),
    /// with k the nearest integer to x/(π/2); |x| < 2^28.
    pub fn reduce_pio2(x: f64) -> (Dd, i64) {
        let k = (x / std::f64::consts::FRAC_PI_2).round();
        let mut expansion = vec![x];
        for &part in &consts().pio2_parts {
            // Shewchuk's grow-expansion: adds -k·part exactly.
            let mut q = -(k * part);
            let mut next = Vec::with_capacity(expansion.len() + 1);
            for &c in &expansion {
                let s = two_sum(q, c);
                if s.lo != 0.0 {
                    next.push(s.lo);
                }
                q = s.hi;
            }
            next.push(q);
            expansion = next;
        }
        let mut r = Dd::ZERO;
        for c in expansion {
            r = r.add(Dd::new(c));
        }
        (r, k as i64)
    }

    fn sin_taylor(r: Dd) -> Dd {
        let r2 = r.mul(r);
        let mut term = r;
        let mut sum = r;
        let mut n = 1.0;
        loop {
            term = term.mul(r2).div(Dd::new(-(2.0 * n) * (2.0 * n + 1.0)));
            sum = sum.add(term);
            if term.hi.abs() <= sum.hi.abs() * 1e-36 || term.hi == 0.0 {
                return sum;
            }
            n += 1.0;
        }
    }

    fn cos_taylor(r: Dd) -> Dd {
        let r2 = r.mul(r);
        let mut term = Dd::ONE;
        let mut sum = Dd::ONE;
        let mut n = 1.0;
        loop {
            term = term.mul(r2).div(Dd::new(-(2.0 * n - 1.0) * (2.0 * n)));
            sum = sum.add(term);
            if term.hi.abs() <= 1e-36 || term.hi == 0.0 {
                return sum;
            }
            n += 1.0;
        }
    }

    pub fn sin(x: f64) -> Dd {
        let (r, k) = reduce_pio2(x);
        match k.rem_euclid(4) {
            0 => sin_taylor(r),
            1 => cos_taylor(r),
            2 => sin_taylor(r).neg(),
            _ => cos_taylor(r).neg(),
        }
    }

    pub fn cos(x: f64) -> Dd {
        let (r, k) = reduce_pio2(x);
        match k.rem_euclid(4) {
            0 => cos_taylor(r),
            1 => sin_taylor(r).neg(),
            2 => cos_taylor(r).neg(),
            _ => sin_taylor(r),
        }
    }

    pub fn tanh(x: f64) -> Dd {
        let a = x.abs();
        let t = if a < 1e-30 {
            // x - x³/3: the cube is below the precision of Dd.
            Dd::new(a)
        } else if a > 40.0 {
            // 1 - 2e^{-2a} with 2e^{-80} below the precision of Dd.
            Dd::ONE
        } else if a < 0.5 {
            let e = expm1(Dd::new(2.0 * a));
            e.div(e.add(Dd::new(2.0)))
        } else {
            let (m, k) = exp(Dd::new(-2.0 * a));
            let e = m.scale(k);
            Dd::ONE.sub(Dd::new(2.0).mul(e).div(Dd::ONE.add(e)))
        };
        if x < 0.0 {
            t.neg()
        } else {
            t
        }
    }

    /// 1/(1 + e^-x) as `(m, k)`.
    pub fn sigmoid(x: f64) -> (Dd, i32) {
        sigmoid_of(Dd::new(x))
    }

    /// 1/(1 + e^-t) for a double-double `t` (|t| < 1e12), as `(m, k)`.
    pub fn sigmoid_of(t: Dd) -> (Dd, i32) {
        if t.hi > 800.0 {
            // 1 - e^{-800}: 1 at the precision of Dd.
            (Dd::ONE, 0)
        } else if t.hi >= 0.0 {
            let (m, k) = exp(t.neg());
            (Dd::ONE.div(Dd::ONE.add(m.scale(k))), 0)
        } else {
            let (m, k) = exp(t);
            (m.div(Dd::ONE.add(m.scale(k))), k)
        }
    }

    /// `x = xm·2^e` with xm in [1, 2) (finite x ≠ 0), so that products
    /// with a tiny x keep their low part.
    fn split(x: f64) -> (Dd, i32) {
        let e = ilogb(x);
        (Dd::new(ldexp(x, -e)), e)
    }

    /// x·σ(x) (SiLU) as `(m, k)`; finite x ≠ 0 above -1e12.
    pub fn silu(x: f64) -> (Dd, i32) {
        let (m, k) = sigmoid(x);
        let (xm, e) = split(x);
        (xm.mul(m), k + e)
    }

    /// x·σ(2√(2/π)·(x + 0.044715·x³)) as `(m, k)`, the exact value of
    /// GELU's tanh form (`(1 + tanh u)/2 = σ(2u)`); finite x ≠ 0 with
    /// |x| ≤ 40. The argument is formed in Dd from the exact cube.
    pub fn gelu_tanh(x: f64) -> (Dd, i32) {
        let c = consts();
        let cube = two_prod(x, x).mul(Dd::new(x));
        let t = c
            .sqrt_8_over_pi
            .mul(Dd::new(x).add(c.gelu_tanh_k.mul(cube)));
        let (m, k) = sigmoid_of(t);
        let (xm, e) = split(x);
        (xm.mul(m), k + e)
    }

    /// ln(1 + e) for -1/2 ≤ e ≤ 1 as 2·atanh(e/(2 + e)) (no cancellation
    /// for small e). Below 2^-900 it is e itself: the next term, -e²/2, is
    /// below the precision of Dd relative to e.
    pub fn ln1p(e: Dd) -> Dd {
        if e.hi.abs() < pow2(-900) {
            return e;
        }
        odd_series(e.div(Dd::new(2.0).add(e)), false).scale(1)
    }

    /// ln(1 + x) for finite x > -1. Near 0 by [`ln1p`]; below -1/2, 1 + x
    /// is exact (Sterbenz); above 1, 1 + x = hi + lo exactly and
    /// ln(hi + lo) = ln(hi) + ln1p(lo/hi).
    pub fn log1p(x: f64) -> Dd {
        if (-0.5..=1.0).contains(&x) {
            ln1p(Dd::new(x))
        } else if x < 0.0 {
            ln(1.0 + x)
        } else {
            let y = two_sum(1.0, x);
            ln(y.hi).add(ln1p(Dd::new(y.lo).div(Dd::new(y.hi))))
        }
    }

    /// e^x - 1 as `(m, k)` for finite |x| < 1e6: [`expm1`] for |x| ≤ 1
    /// (x itself below 2^-900, where x²/2 is below the precision of Dd
    /// relative to x), else from [`exp`], which loses under one bit to
    /// the subtraction there.
    pub fn expm1_of(x: f64) -> (Dd, i32) {
        if x.abs() < pow2(-900) {
            (Dd::new(x), 0)
        } else if x.abs() <= 1.0 {
            (expm1(Dd::new(x)), 0)
        } else {
            let (m, k) = exp(Dd::new(x));
            if x > 0.0 {
                (m.sub(Dd::ONE.scale(-k)), k)
            } else {
                (m.scale(k).sub(Dd::ONE), 0)
            }
        }
    }

    /// ln(1 + e^x) as `(m, k)` for finite |x| < 1e12: x + ln1p(e^-x) for
    /// x ≥ 0, ln1p(e^x) below; for e^x < 2^-199 it is e^x itself (the next
    /// term, -e^{2x}/2, is below the precision of Dd).
    pub fn softplus(x: f64) -> (Dd, i32) {
        if x > 800.0 {
            // ln1p(e^-800) < 2^-1150: x at the precision of Dd.
            (Dd::new(x), 0)
        } else if x >= 0.0 {
            let (m, k) = exp(Dd::new(-x));
            (Dd::new(x).add(ln1p(m.scale(k))), 0)
        } else {
            let (m, k) = exp(Dd::new(x));
            if k < -200 {
                (m, k)
            } else {
                (ln1p(m.scale(k)), 0)
            }
        }
    }

    /// 1/x as `(m, k)` for finite x ≠ 0 (scaled, so that neither an
    /// overflowing nor a subnormal result loses bits inside Dd).
    pub fn reciprocal(x: f64) -> (Dd, i32) {
        let (xm, e) = split(x);
        (Dd::ONE.div(xm), -e)
    }

    /// x² exactly as `(m, k)` for finite x ≠ 0.
    pub fn square(x: f64) -> (Dd, i32) {
        let (xm, e) = split(x);
        (two_prod(xm.hi, xm.hi), 2 * e)
    }

    /// erf(x) as `(m, k)` for finite x ≠ 0: the positive-term series below
    /// |x| = 2.5 (with x scaled to [1, 2): the series is linear in its
    /// first term, so a subnormal x keeps its bits), 1 - erfc above.
    pub fn erf(x: f64) -> (Dd, i32) {
        let a = x.abs();
        let (m, k) = if a > 40.0 {
            // erfc(40) < e^{-1600}: 1 at the precision of Dd.
            (Dd::ONE, 0)
        } else if a < 2.5 {
            let (am, e) = split(a);
            (erf_series(am, two_prod(a, a)), e)
        } else {
            let (m, k) = erfc_fraction(Dd::new(a), two_prod(a, a));
            (Dd::ONE.sub(m.scale(k)), 0)
        };
        (if x < 0.0 { m.neg() } else { m }, k)
    }

    /// erf(z) for 0 ≤ z < 2.5: (2/√π) e^{-z²} Σ 2^n z^(2n+1)/(2n+1)!!, a
    /// series of positive terms (no cancellation); `z2` is z² exactly.
    /// Linear in `z` for a given `z2`: `z` may be scaled by a power of two.
    fn erf_series(z: Dd, z2: Dd) -> Dd {
        let two_z2 = z2.scale(1);
        let mut term = z;
        let mut sum = z;
        let mut n = 1.0;
        loop {
            term = term.mul(two_z2).div(Dd::new(2.0 * n + 1.0));
            sum = sum.add(term);
            if term.hi.abs() <= sum.hi.abs() * 1e-36 || term.hi == 0.0 {
                break;
            }
            n += 1.0;
        }
        let (m, k) = exp(z2.neg());
        consts().frac_2_sqrt_pi.mul(m.scale(k)).mul(sum)
    }

    /// erfc(z) for z ≥ 2.5 by its continued fraction (120 terms: agrees with
    /// the series to 2e-28 at the switch, see `reference_self_checks`), as `(m, k)`:
    /// e^{-z²}/√π · 1/(z + (1/2)/(z + 1/(z + (3/2)/(z + ...)))).
    fn erfc_fraction(z: Dd, z2: Dd) -> (Dd, i32) {
        let mut t = z;
        for n in (1..=120).rev() {
            t = z.add(Dd::new(n as f64 / 2.0).div(t));
        }
        let (m, k) = exp(z2.neg());
        (consts().frac_1_sqrt_pi.mul(m).div(t), k)
    }

    /// erfc(z) for z ≥ 0 as `(m, k)`; `z2` is z² exactly.
    pub fn erfc(z: Dd, z2: Dd) -> (Dd, i32) {
        if z.hi < 2.5 {
            (Dd::ONE.sub(erf_series(z, z2)), 0)
        } else {
            erfc_fraction(z, z2)
        }
    }

    /// The series and the fraction at the switch point, for a self-check.
    pub fn erfc_both_at(z: f64) -> (Dd, Dd) {
        let z2 = two_prod(z, z);
        let (m, k) = erfc_fraction(Dd::new(z), z2);
        (Dd::ONE.sub(erf_series(Dd::new(z), z2)), m.scale(k))
    }

    /// x·Φ(x) = x·erfc(-x/√2)/2 as `(m, k)`.
    pub fn gelu(x: f64) -> (Dd, i32) {
        if x > 40.0 {
            // Φ(x) = 1 - erfc(x/√2)/2 with erfc below e^{-800}.
            return (Dd::new(x), 0);
        }
        let z2 = two_prod(x, x).scale(-1);
        let z = Dd::new(x.abs()).mul(consts().frac_1_sqrt_2);
        let (m, k) = erfc(z, z2);
        // x = xm·2^e with xm in [1, 2), so that products with a tiny x
        // keep their low part (x/2 may be below the subnormal range).
        let e = ilogb(x);
        let xm = Dd::new(ldexp(x, -e));
        if x >= 0.0 {
            // Φ(x) = 1 - erfc(|x|/√2)/2.
            let phi = Dd::ONE.sub(m.scale(k - 1));
            (xm.mul(phi), e)
        } else {
            (xm.mul(m).scale(-1), k + e)
        }
    }

    /// |a|^b for finite a ≠ 0 and finite b, as `(m, k)`; `None` when
    /// b·ln|a| is beyond any format (the caller expects 0 or inf).
    pub fn pow_abs(a: f64, b: f64) -> Option<(Dd, i32)> {
        let l = ln(a.abs()).mul(Dd::new(b));
        // b·ln|a| may overflow to inf or NaN for huge b.
        if l.hi.is_nan() || l.hi.abs() > 1e6 {
            return None;
        }
        Some(exp(l))
    }
}

use dd::{two_prod, two_sum, Dd};

// ---------------------------------------------------------------------------
// Formats and the error measure.

/// A binary floating-point format: precision (bits, with the implicit one)
/// and exponent range of normal numbers.
#[derive(Clone, Copy, Debug)]
struct Format {
    p: i32,
    emin: i32,
    emax: i32,
}

/// The element types under test.
trait Float: FloatElement + Copy + std::fmt::Debug {
    const FORMAT: Format;
    /// Bits in a pattern.
    const BITS: u32;
    fn from_pattern(bits: u64) -> Self;
    fn from_f64(v: f64) -> Self;
}

impl Float for f32 {
    const FORMAT: Format = Format {
        p: 24,
        emin: -126,
        emax: 127,
    };
    const BITS: u32 = 32;
    fn from_pattern(bits: u64) -> f32 {
        f32::from_bits(bits as u32)
    }
    fn from_f64(v: f64) -> f32 {
        v as f32
    }
}

impl Float for f64 {
    const FORMAT: Format = Format {
        p: 53,
        emin: -1022,
        emax: 1023,
    };
    const BITS: u32 = 64;
    fn from_pattern(bits: u64) -> f64 {
        f64::from_bits(bits)
    }
    fn from_f64(v: f64) -> f64 {
        v
    }
}

impl Float for f16 {
    const FORMAT: Format = Format {
        p: 11,
        emin: -14,
        emax: 15,
    };
    const BITS: u32 = 16;
    fn from_pattern(bits: u64) -> f16 {
        f16::from_bits(bits as u16)
    }
    fn from_f64(v: f64) -> f16 {
        f16::from_f64(v)
    }
}

impl Float for bf16 {
    const FORMAT: Format = Format {
        p: 8,
        emin: -126,
        emax: 127,
    };
    const BITS: u32 = 16;
    fn from_pattern(bits: u64) -> bf16 {
        bf16::from_bits(bits as u16)
    }
    fn from_f64(v: f64) -> bf16 {
        bf16::from_f64(v)
    }
}

/// The exact result of a function at one input.
#[derive(Clone, Copy, Debug)]
enum Exact {
    /// `m·2^k` (m non-zero, finite).
    Value(Dd, i32),
    /// An exact zero; `negative` is its sign.
    Zero {
        negative: bool,
    },
    /// Exactly ±inf (a pole or an infinite input).
    Inf {
        negative: bool,
    },
    Nan,
    /// Not measured (documented gaps, e.g. huge sin/cos arguments): the
    /// result must lie in [lo, hi].
    Within(f64, f64),
}

fn value(d: Dd) -> Exact {
    if d.hi == 0.0 {
        Exact::Zero {
            negative: d.hi.is_sign_negative(),
        }
    } else {
        Exact::Value(d, 0)
    }
}

/// The error of `got` in ulps of format `f` (infinite for a wrong special).
fn ulp_error(got: f64, exact: Exact, f: Format) -> f64 {
    match exact {
        Exact::Nan => {
            if got.is_nan() {
                0.0
            } else {
                f64::INFINITY
            }
        }
        Exact::Zero { negative } => {
            if got == 0.0 && got.is_sign_negative() == negative {
                0.0
            } else {
                f64::INFINITY
            }
        }
        Exact::Inf { negative } => {
            if got.is_infinite() && (got < 0.0) == negative {
                0.0
            } else {
                f64::INFINITY
            }
        }
        Exact::Within(lo, hi) => {
            if got >= lo && got <= hi {
                0.0
            } else {
                f64::INFINITY
            }
        }
        Exact::Value(m, k) => {
            assert!(
                m.hi != 0.0 && m.hi.is_finite(),
                "a reference value must be finite and non-zero: {m:?}·2^{k}"
            );
            if got.is_nan() {
                return f64::INFINITY;
            }
            let e_ref = dd::ilogb(m.hi) + k;
            // Overflow: at or beyond MAX + ulp/2 rounds to inf.
            let mantissa = (m.hi + m.lo).abs() * dd::pow2(-dd::ilogb(m.hi));
            let overflows = e_ref > f.emax || (e_ref == f.emax && mantissa >= 2.0 - dd::pow2(-f.p));
            if overflows {
                return if got.is_infinite() && (got < 0.0) == (m.hi < 0.0) {
                    0.0
                } else {
                    f64::INFINITY
                };
            }
            if got.is_infinite() {
                return f64::INFINITY;
            }
            let u = e_ref.max(f.emin) - (f.p - 1);
            let a = dd::ldexp(got, -u);
            let b = m.scale(k - u);
            ((a - b.hi) - b.lo).abs()
        }
    }
}

// ---------------------------------------------------------------------------
// Inputs.

/// Bit patterns of positive values from `lo` to `hi` (as f64), `count` of
/// them evenly strided: log-uniform coverage of the range.
fn strided_range<T: Float>(lo: f64, hi: f64, count: u64) -> Vec<T> {
    let (a, b) = (pattern_of::<T>(lo), pattern_of::<T>(hi));
    let step = ((b - a) / count).max(1);
    (0..count)
        .map(|i| a + i * step)
        .take_while(|&p| p <= b)
        .map(T::from_pattern)
        .collect()
}

/// The pattern of the positive value of `T` nearest `v`.
fn pattern_of<T: Float>(v: f64) -> u64 {
    let t = T::from_f64(v).to_f64();
    match T::BITS {
        16 | 32 => {
            // Search: patterns of positive values are ordered like values.
            let (mut lo, mut hi) = (0u64, (1u64 << (T::BITS - 1)) - 1);
            while lo < hi {
                let mid = (lo + hi).div_ceil(2);
                let m = T::from_pattern(mid).to_f64();
                if m.is_nan() || m > t {
                    hi = mid - 1;
                } else {
                    lo = mid;
                }
            }
            lo
        }
        _ => t.to_bits(),
    }
}

/// The inputs of one sweep: all patterns (16-bit types) or strided
/// patterns over the whole range and over `ranges`, consecutive patterns
/// around `centers`, each of both signs.
fn sweep<T: Float>(ranges: &[(f64, f64)], centers: &[f64]) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    if T::BITS == 16 {
        out.extend((0..1u64 << 16).map(T::from_pattern));
        return out;
    }
    let (whole, per_range) = if T::BITS == 32 {
        (1u64 << 20, 1u64 << 19)
    } else {
        (1u64 << 18, 1u64 << 18)
    };
    let stride = ((u64::MAX >> (64 - T::BITS)) / whole) | 1;
    out.extend(
        (0..whole).map(|i| T::from_pattern(i.wrapping_mul(stride) & (u64::MAX >> (64 - T::BITS)))),
    );
    for &(lo, hi) in ranges {
        let positive = strided_range::<T>(lo, hi, per_range / 2);
        out.extend(positive.iter().map(|&v| T::from_f64(-v.to_f64())));
        out.extend(positive);
    }
    for &c in centers {
        let p = pattern_of::<T>(c.abs()) as i64;
        for d in -2048i64..2048 {
            let q = p + d;
            if q >= 0 {
                let v = T::from_pattern(q as u64);
                out.push(v);
                out.push(T::from_f64(-v.to_f64()));
            }
        }
    }
    out
}

/// Special inputs of every dtype.
fn specials<T: Float>() -> Vec<T> {
    let max = T::from_pattern(pattern_of::<T>(f64::INFINITY) - 1);
    let tiny = T::from_pattern(1);
    [
        0.0,
        -0.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        max.to_f64(),
        -max.to_f64(),
        tiny.to_f64(),
        -tiny.to_f64(),
        1.0,
        -1.0,
    ]
    .into_iter()
    .map(T::from_f64)
    .collect()
}

// ---------------------------------------------------------------------------
// Running the kernels and measuring.

/// The maximum error of a sweep, and where.
#[derive(Debug)]
struct Measured {
    max: f64,
    at: String,
    points: usize,
}

fn measure<T: Float>(
    inputs: &[T],
    got: &[T],
    exact: impl Fn(f64) -> Exact,
    describe: impl Fn(usize) -> String,
) -> Measured {
    let mut m = Measured {
        max: 0.0,
        at: String::new(),
        points: inputs.len(),
    };
    for (i, (x, y)) in inputs.iter().zip(got).enumerate() {
        let e = ulp_error(y.to_f64(), exact(x.to_f64()), T::FORMAT);
        // NaN errors never occur (ulp_error maps wrong NaNs to inf).
        if e > m.max {
            m.max = e;
            m.at = format!("{} -> {:?}", describe(i), y);
        }
    }
    m
}

fn unary<T: Float>(
    op: fn(&Tensor<T>) -> Tensor<T>,
    exact: &dyn Fn(f64) -> Exact,
    ranges: &[(f64, f64)],
    centers: &[f64],
) -> Measured {
    let cpu = Device::cpu();
    let mut inputs = sweep::<T>(ranges, centers);
    inputs.extend(specials::<T>());
    let t = Tensor::from_slice(&inputs, &[inputs.len()], &cpu).unwrap();
    let got = op(&t).to_vec().unwrap();
    measure(&inputs, &got, exact, |i| format!("{:?}", inputs[i]))
}

/// Bounds for f32, f16 and bf16: correctly rounded but for results within
/// 2^-20 ulp of a tie (the kernels round an f64 result once).
const NARROW_BOUND: f64 = 0.5 + 1.0 / (1u64 << 20) as f64;

/// Maximum f64 errors allowed per function (see `docs/accuracy.md`).
const F64_BOUNDS: &[(&str, f64)] = &[
    ("exp", 1.0),
    ("log", 1.0),
    ("sqrt", 0.5),
    ("rsqrt", 1.5),
    ("tanh", 2.5),
    ("sigmoid", 2.5),
    ("gelu", 4.0),
    ("sin", 1.0),
    ("cos", 1.0),
    ("pow", 1.0),
    ("erf", 1.5),
    ("gelu_tanh", 4.0),
    ("silu", 3.5),
    ("softplus", 2.0),
    ("log1p", 1.0),
    ("expm1", 1.0),
    ("reciprocal", 0.5),
    ("square", 0.5),
];

fn f64_bound(name: &str) -> f64 {
    F64_BOUNDS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, b)| *b)
        .expect("a bound for every function")
}

/// The op under test for each dtype: f32, f64, f16, bf16.
type Ops = (
    fn(&Tensor<f32>) -> Tensor<f32>,
    fn(&Tensor<f64>) -> Tensor<f64>,
    fn(&Tensor<f16>) -> Tensor<f16>,
    fn(&Tensor<bf16>) -> Tensor<bf16>,
);

fn check_unary(
    name: &str,
    exact: &dyn Fn(f64) -> Exact,
    ranges: &[(f64, f64)],
    centers: &[f64],
    ops: Ops,
) {
    let results = [
        (
            "f32",
            unary::<f32>(ops.0, exact, ranges, centers),
            NARROW_BOUND,
        ),
        (
            "f64",
            unary::<f64>(ops.1, exact, ranges, centers),
            f64_bound(name),
        ),
        (
            "f16",
            unary::<f16>(ops.2, exact, ranges, centers),
            NARROW_BOUND,
        ),
        (
            "bf16",
            unary::<bf16>(ops.3, exact, ranges, centers),
            NARROW_BOUND,
        ),
    ];
    report(name, &results);
}

fn report(name: &str, results: &[(&str, Measured, f64)]) {
    for (dtype, m, bound) in results {
        eprintln!(
            "{name} {dtype}: max {:.6} ulp over {} inputs (bound {bound}), worst at {}",
            m.max, m.points, m.at
        );
    }
    for (dtype, m, bound) in results {
        assert!(
            m.max <= *bound,
            "{name} {dtype}: {} ulp > {bound} at {}",
            m.max,
            m.at
        );
    }
}

macro_rules! ops {
    ($method:ident) => {
        (
            |t: &Tensor<f32>| t.$method(),
            |t: &Tensor<f64>| t.$method(),
            |t: &Tensor<f16>| t.$method(),
            |t: &Tensor<bf16>| t.$method(),
        )
    };
}

/// NaN in, NaN out; ±inf and ±0 as given; else `f`.
fn with_specials(x: f64, pos_inf: Exact, neg_inf: Exact, f: impl Fn(f64) -> Exact) -> Exact {
    if x.is_nan() {
        Exact::Nan
    } else if x == f64::INFINITY {
        pos_inf
    } else if x == f64::NEG_INFINITY {
        neg_inf
    } else {
        f(x)
    }
}

const POS_INF: Exact = Exact::Inf { negative: false };
const NEG_INF: Exact = Exact::Inf { negative: true };
const ONE: Exact = Exact::Value(Dd::ONE, 0);
const PLUS_ZERO: Exact = Exact::Zero { negative: false };

fn zero_like(x: f64) -> Exact {
    Exact::Zero {
        negative: x.is_sign_negative(),
    }
}

#[test]
fn reference_self_checks() {
    let c = dd::consts();
    assert_eq!(c.pi.hi, std::f64::consts::PI);
    assert_eq!(c.ln2.hi, std::f64::consts::LN_2);
    assert_eq!(c.frac_1_sqrt_2.hi, std::f64::consts::FRAC_1_SQRT_2);
    assert_eq!(c.frac_2_sqrt_pi.hi, std::f64::consts::FRAC_2_SQRT_PI);
    // The hexadecimal digits of pi agree with Machin's formula.
    let mut parts = Dd::ZERO;
    for p in c.pio2_parts.iter().rev() {
        parts = parts.add(Dd::new(*p));
    }
    let diff = parts.scale(1).sub(c.pi);
    assert!(diff.hi.abs() < 1e-30, "pi digits: {diff:?}");
    // exp and ln invert each other; sin² + cos² = 1.
    for x in [0.3, 1.7, 123.456, 1e-5, 700.0] {
        let (m, k) = dd::exp(dd::ln(x).neg());
        let back = m.scale(k).mul(Dd::new(x)).sub(Dd::ONE);
        assert!(back.hi.abs() < 1e-30, "exp(-ln {x}) * {x} - 1 = {back:?}");
        let (s, co) = (dd::sin(x), dd::cos(x));
        let one = s.mul(s).add(co.mul(co)).sub(Dd::ONE);
        assert!(one.hi.abs() < 1e-30, "sin²+cos² at {x}: {one:?}");
    }
    // The erfc series and continued fraction agree where they meet (the
    // series loses bits to cancellation above, the fraction converges
    // slowly below).
    let (series, fraction) = dd::erfc_both_at(2.5);
    let rel = series.sub(fraction).div(fraction);
    assert!(
        rel.hi.abs() < 1e-26,
        "erfc(2.5): {series:?} vs {fraction:?}"
    );
    // The references of the newer functions: known values (decimals from
    // a 50-digit computation, as hi + lo) and identities between them.
    let close = |got: (Dd, i32), want: Dd, what: &str| {
        let got = got.0.scale(got.1);
        let rel = got.sub(want).hi.abs() / want.hi.abs();
        assert!(rel < 1e-30, "{what}: {got:?} vs {want:?} ({rel:e})");
    };
    let dd2 = |hi: f64, lo: f64| Dd { hi, lo };
    // erf(1) = 0.84270079294971486934122063508261 (series), erf(3) =
    // 0.99997790950300141455862722387042 (continued fraction).
    close(
        dd::erf(1.0),
        dd2(0.842_700_792_949_714_9, -2.480_101_178_911_860_2e-17),
        "erf(1)",
    );
    close(
        dd::erf(3.0),
        dd2(0.999_977_909_503_001_4, 5.363_397_058_636_269e-17),
        "erf(3)",
    );
    // gelu_tanh(1) = 0.84119199060827670478199577704518, gelu_tanh(-3) =
    // -0.0036373920817730188378164661318914.
    close(
        dd::gelu_tanh(1.0),
        dd2(0.841_191_990_608_276_7, 5.296_238_767_190_235_3e-17),
        "gelu_tanh(1)",
    );
    close(
        dd::gelu_tanh(-3.0),
        dd2(-0.003_637_392_081_773_019, 2.164_362_496_440_963_9e-19),
        "gelu_tanh(-3)",
    );
    // softplus(0) = ln 2; f(x) - f(-x) = x for silu, gelu_tanh, softplus.
    close(dd::softplus(0.0), c.ln2, "softplus(0)");
    for x in [0.7, 3.0, 50.0] {
        for (name, f) in [
            ("silu", dd::silu as fn(f64) -> (Dd, i32)),
            ("gelu_tanh", dd::gelu_tanh),
            ("softplus", dd::softplus),
        ] {
            let (a, ka) = f(x);
            let (b, kb) = f(-x);
            close(
                (a.scale(ka).sub(b.scale(kb)), 0),
                Dd::new(x),
                &format!("{name}({x}) - {name}(-{x})"),
            );
        }
    }
    // log1p and expm1: inverse to each other, e^{log1p x} = 1 + x, and
    // their series near 0 (x - x²/2 + x³/3, x + x²/2 + x³/6).
    for x in [0.3, -0.45, 0.9] {
        close(
            (dd::ln1p(dd::expm1_of(x).0), 0),
            Dd::new(x),
            &format!("log1p(expm1({x}))"),
        );
        let (m, k) = dd::exp(dd::log1p(x));
        close((m, k), two_sum(1.0, x), &format!("e^log1p({x})"));
    }
    for x in [-0.7, 5.0, 1e10, 1e300] {
        let (m, k) = dd::exp(dd::log1p(x));
        close((m, k), two_sum(1.0, x), &format!("e^log1p({x})"));
    }
    for x in [-5.0, 2.5, 100.0] {
        let (m, k) = dd::exp(Dd::new(x));
        close(
            dd::expm1_of(x),
            m.scale(k).sub(Dd::ONE),
            &format!("expm1({x})"),
        );
    }
    let x = 1e-20;
    let x2 = two_prod(x, x).scale(-1);
    let x3 = two_prod(x, x).mul(Dd::new(x));
    close(
        (dd::log1p(x), 0),
        Dd::new(x).sub(x2).add(x3.div(Dd::new(3.0))),
        "log1p(1e-20)",
    );
    close(
        dd::expm1_of(x),
        Dd::new(x).add(x2).add(x3.div(Dd::new(6.0))),
        "expm1(1e-20)",
    );
    // reciprocal and square.
    let (m, k) = dd::reciprocal(3.0);
    close((m.mul(Dd::new(3.0)), k), Dd::ONE, "3·(1/3)");
    let (m, k) = dd::reciprocal(f64::MAX);
    close(
        (m.mul(Dd::new(f64::MAX)).scale(k), 0),
        Dd::ONE,
        "MAX·(1/MAX)",
    );
    let x = 1.0 + dd::pow2(-30);
    close(
        dd::square(x),
        dd2(1.0 + dd::pow2(-29), dd::pow2(-60)),
        "square",
    );
    // The ulp measure itself.
    let err = ulp_error(1.0 + f64::EPSILON, Exact::Value(Dd::ONE, 0), f64::FORMAT);
    assert_eq!(err, 1.0);
    let err = ulp_error(
        0.5,
        Exact::Value(
            Dd {
                hi: 0.5,
                lo: f64::EPSILON / 4.0,
            },
            0,
        ),
        f64::FORMAT,
    );
    assert_eq!(err, 0.5);
}

#[test]
fn exp_accuracy() {
    let exact = |x: f64| {
        with_specials(x, POS_INF, PLUS_ZERO, |x| {
            if x.abs() > 1e6 {
                return if x > 0.0 { POS_INF } else { PLUS_ZERO };
            }
            let (m, k) = dd::exp(Dd::new(x));
            Exact::Value(m, k)
        })
    };
    check_unary(
        "exp",
        &exact,
        &[(1e-9, 1.0), (1.0, 750.0)],
        &[
            0.0,
            1.0,
            88.72,
            103.97,
            11.09,
            709.78,
            745.13,
            17.33,
            std::f64::consts::LN_2,
        ],
        ops!(exp),
    );
}

#[test]
fn log_accuracy() {
    let exact = |x: f64| {
        with_specials(x, POS_INF, Exact::Nan, |x| {
            if x == 0.0 {
                NEG_INF
            } else if x < 0.0 {
                Exact::Nan
            } else if x == 1.0 {
                PLUS_ZERO
            } else {
                value(dd::ln(x))
            }
        })
    };
    check_unary(
        "log",
        &exact,
        &[(0.5, 2.0), (1e-40, 1e40)],
        &[1.0, 0.5, 2.0, std::f64::consts::E, 1e-38],
        ops!(log),
    );
}

#[test]
fn sqrt_and_rsqrt_accuracy() {
    let sqrt = |x: f64| {
        with_specials(x, POS_INF, Exact::Nan, |x| {
            if x == 0.0 {
                zero_like(x)
            } else if x < 0.0 {
                Exact::Nan
            } else {
                value(Dd::new(x).sqrt())
            }
        })
    };
    let rsqrt = |x: f64| {
        with_specials(x, PLUS_ZERO, Exact::Nan, |x| {
            if x == 0.0 {
                Exact::Inf {
                    negative: x.is_sign_negative(),
                }
            } else if x < 0.0 {
                Exact::Nan
            } else {
                value(Dd::ONE.div(Dd::new(x).sqrt()))
            }
        })
    };
    let ranges = [(1e-30, 1e30), (1.0, 4.0)];
    let centers = [1.0, 2.0, 4.0, 0.25];
    check_unary("sqrt", &sqrt, &ranges, &centers, ops!(sqrt));
    check_unary("rsqrt", &rsqrt, &ranges, &centers, ops!(rsqrt));
}

#[test]
fn tanh_accuracy() {
    let exact = |x: f64| {
        with_specials(x, ONE, Exact::Value(Dd::ONE.neg(), 0), |x| {
            if x == 0.0 {
                zero_like(x)
            } else {
                value(dd::tanh(x))
            }
        })
    };
    check_unary(
        "tanh",
        &exact,
        &[(1e-10, 0.6), (0.5, 25.0)],
        &[0.0, 0.5, 0.55, 1.0, 9.01, 19.06],
        ops!(tanh),
    );
}

#[test]
fn sigmoid_accuracy() {
    let exact = |x: f64| {
        with_specials(x, ONE, PLUS_ZERO, |x| {
            if x < -1e6 {
                return PLUS_ZERO;
            }
            let (m, k) = dd::sigmoid(x);
            Exact::Value(m, k)
        })
    };
    check_unary(
        "sigmoid",
        &exact,
        &[(1e-10, 1.0), (1.0, 800.0)],
        &[0.0, 1.0, 16.6, 36.7, 88.7, 103.97, 745.1],
        ops!(sigmoid),
    );
}

#[test]
fn gelu_accuracy() {
    let exact = |x: f64| {
        with_specials(x, POS_INF, Exact::Zero { negative: true }, |x| {
            if x == 0.0 {
                return zero_like(x);
            }
            if x < -1500.0 {
                // x·Φ(x) < 2^-1e6: a negative zero in every format.
                return Exact::Zero { negative: true };
            }
            if x > 1e10 {
                // Φ(x) = 1 - e^{-5e19}: exactly x in every format.
                return Exact::Value(Dd::new(x), 0);
            }
            let (m, k) = dd::gelu(x);
            if m.hi == 0.0 {
                Exact::Zero { negative: true }
            } else {
                Exact::Value(m, k)
            }
        })
    };
    check_unary(
        "gelu",
        &exact,
        &[(1e-10, 1.0), (1.0, 40.0)],
        &[0.0, 0.75, 1.0, 5.0, 7.07, 10.0, 14.0, 38.5, 13.3],
        ops!(gelu),
    );
}

#[test]
fn erf_accuracy() {
    let exact = |x: f64| {
        with_specials(x, ONE, Exact::Value(Dd::ONE.neg(), 0), |x| {
            if x == 0.0 {
                return zero_like(x);
            }
            let (m, k) = dd::erf(x);
            Exact::Value(m, k)
        })
    };
    check_unary(
        "erf",
        &exact,
        &[(1e-10, 1.0), (1.0, 6.0)],
        // 0.84375, 1.25, 2.857 and 6: the kernel's interval switches; 2.5:
        // the reference's; 3.92 and 5.93: where erf rounds to 1 in f32 and
        // f64.
        &[0.0, 0.84375, 1.0, 1.25, 2.5, 2.857, 3.92, 5.93, 6.0],
        ops!(erf),
    );
}

#[test]
fn gelu_tanh_accuracy() {
    let exact = |x: f64| {
        with_specials(x, POS_INF, Exact::Zero { negative: true }, |x| {
            if x == 0.0 {
                return zero_like(x);
            }
            if x < -40.0 {
                // The sigmoid's argument is below -4600: a negative zero
                // in every format.
                return Exact::Zero { negative: true };
            }
            if x > 40.0 {
                // σ(t) = 1 - e^{-4600}: exactly x in every format.
                return Exact::Value(Dd::new(x), 0);
            }
            let (m, k) = dd::gelu_tanh(x);
            Exact::Value(m, k)
        })
    };
    check_unary(
        "gelu_tanh",
        &exact,
        &[(1e-10, 1.0), (1.0, 40.0)],
        // 10.4 and 21.6: where the result underflows in f32 and f64.
        &[0.0, 0.75, 1.0, 3.0, 5.0, 10.4, 21.6],
        ops!(gelu_tanh),
    );
}

#[test]
fn silu_accuracy() {
    let exact = |x: f64| {
        with_specials(x, POS_INF, Exact::Zero { negative: true }, |x| {
            if x == 0.0 {
                return zero_like(x);
            }
            if x < -1e5 {
                // x·σ(x) < 2^-1e5: a negative zero in every format.
                return Exact::Zero { negative: true };
            }
            let (m, k) = dd::silu(x);
            Exact::Value(m, k)
        })
    };
    check_unary(
        "silu",
        &exact,
        &[(1e-10, 1.0), (1.0, 800.0)],
        // 108.7 and 750.2: where the result underflows in f32 and f64;
        // 708.4 to 715: e^x is subnormal in f64 while x·σ(x) is not.
        &[
            0.0, 1.0, 16.6, 36.7, 88.7, 108.7, 708.4, 712.0, 715.0, 750.2,
        ],
        ops!(silu),
    );
}

#[test]
fn softplus_accuracy() {
    let exact = |x: f64| {
        with_specials(x, POS_INF, PLUS_ZERO, |x| {
            if x < -1e5 {
                // e^x < 2^-1e5: a positive zero in every format.
                return PLUS_ZERO;
            }
            let (m, k) = dd::softplus(x);
            Exact::Value(m, k)
        })
    };
    check_unary(
        "softplus",
        &exact,
        &[(1e-10, 1.0), (1.0, 800.0)],
        // 16.6 and 36.7: where x + ln(1 + e^-x) rounds to x in f32 and
        // f64; 103.97 and 745.13: where e^x underflows in them.
        &[0.0, 1.0, 16.6, 36.7, 103.97, 708.4, 745.13],
        ops!(softplus),
    );
}

#[test]
fn log1p_accuracy() {
    let exact = |x: f64| {
        with_specials(x, POS_INF, Exact::Nan, |x| {
            if x == 0.0 {
                zero_like(x)
            } else if x == -1.0 {
                NEG_INF
            } else if x < -1.0 {
                Exact::Nan
            } else {
                value(dd::log1p(x))
            }
        })
    };
    check_unary(
        "log1p",
        &exact,
        &[(1e-10, 1.0), (1.0, 1e30)],
        // ±1 (the pole at -1), ±1/2 and √2 - 1, 1 - 1/√2: the switches of
        // the reference and of common kernels.
        &[
            0.0,
            0.5,
            1.0,
            0.414_213_562_373_095,
            0.292_893_218_813_452_5,
        ],
        ops!(log1p),
    );
}

#[test]
fn expm1_accuracy() {
    let exact = |x: f64| {
        with_specials(x, POS_INF, Exact::Value(Dd::ONE.neg(), 0), |x| {
            if x == 0.0 {
                zero_like(x)
            } else if x > 1e6 {
                POS_INF
            } else if x < -1e6 {
                // -1 + e^-1e6: -1 in every format.
                Exact::Value(Dd::ONE.neg(), 0)
            } else {
                let (m, k) = dd::expm1_of(x);
                Exact::Value(m, k)
            }
        })
    };
    check_unary(
        "expm1",
        &exact,
        &[(1e-9, 1.0), (1.0, 750.0)],
        // ln2/2 and ln2: common reduction switches; 88.72 and 709.78:
        // overflow in f32 and f64; 17.33 and 37.43: where the result
        // rounds to -1 in f32 and f64.
        &[
            0.0,
            0.346_573_590_279_972_65,
            std::f64::consts::LN_2,
            1.0,
            17.33,
            37.43,
            88.72,
            709.78,
        ],
        ops!(expm1),
    );
}

#[test]
fn reciprocal_and_square_accuracy() {
    let reciprocal = |x: f64| {
        with_specials(x, PLUS_ZERO, Exact::Zero { negative: true }, |x| {
            if x == 0.0 {
                Exact::Inf {
                    negative: x.is_sign_negative(),
                }
            } else {
                let (m, k) = dd::reciprocal(x);
                Exact::Value(m, k)
            }
        })
    };
    let square = |x: f64| {
        with_specials(x, POS_INF, POS_INF, |x| {
            if x == 0.0 {
                PLUS_ZERO
            } else {
                let (m, k) = dd::square(x);
                Exact::Value(m, k)
            }
        })
    };
    let ranges = [(1e-30, 1e30), (1.0, 2.0)];
    // 1/MAX of f32 and f64 (where 1/x overflows), √MAX and √(smallest
    // subnormal) of f32 (where x² overflows and underflows).
    let centers = [
        1.0,
        2.0,
        3.0,
        2.938_735_877_055_719e-39,
        5.562_684_646_268_003e-309,
        1.844_674_4e19,
        3.743_392e-23,
    ];
    check_unary(
        "reciprocal",
        &reciprocal,
        &ranges,
        &centers,
        ops!(reciprocal),
    );
    check_unary("square", &square, &ranges, &centers, ops!(square));
}

#[test]
fn sin_and_cos_accuracy() {
    const LIMIT: f64 = 268_435_456.0; // 2^28
    let sin = |x: f64| {
        with_specials(x, Exact::Nan, Exact::Nan, |x| {
            if x == 0.0 {
                zero_like(x)
            } else if x.abs() >= LIMIT {
                Exact::Within(-1.0, 1.0)
            } else {
                value(dd::sin(x))
            }
        })
    };
    let cos = |x: f64| {
        with_specials(x, Exact::Nan, Exact::Nan, |x| {
            if x.abs() >= LIMIT {
                Exact::Within(-1.0, 1.0)
            } else {
                value(dd::cos(x))
            }
        })
    };
    let ranges = [(1e-8, 7.0), (7.0, 1e6)];
    let centers = [
        0.0,
        std::f64::consts::FRAC_PI_2,
        std::f64::consts::PI,
        3.0 * std::f64::consts::FRAC_PI_2,
        std::f64::consts::TAU,
        100.0 * std::f64::consts::PI,
        22.0,
        355.0,
        103_993.0,
    ];
    check_unary("sin", &sin, &ranges, &centers, ops!(sin));
    check_unary("cos", &cos, &ranges, &centers, ops!(cos));
}

/// The exact pow(a, b), C99 Annex F specials included.
fn pow_exact(a: f64, b: f64) -> Exact {
    let is_int = |v: f64| v.is_finite() && v == v.trunc();
    let is_odd = |v: f64| is_int(v) && (v / 2.0).fract() != 0.0;
    if b == 0.0 || a == 1.0 {
        return ONE;
    }
    if a.is_nan() || b.is_nan() {
        return Exact::Nan;
    }
    if a == 0.0 {
        let negative = a.is_sign_negative() && is_odd(b);
        return if b < 0.0 {
            Exact::Inf { negative }
        } else {
            Exact::Zero { negative }
        };
    }
    if b.is_infinite() {
        let big = a.abs() > 1.0;
        return if a == -1.0 {
            ONE
        } else if big == (b > 0.0) {
            POS_INF
        } else {
            PLUS_ZERO
        };
    }
    if a.is_infinite() {
        let negative = a < 0.0 && is_odd(b);
        return if b > 0.0 {
            Exact::Inf { negative }
        } else {
            Exact::Zero { negative }
        };
    }
    if a < 0.0 && !is_int(b) {
        return Exact::Nan;
    }
    let negative = a < 0.0 && is_odd(b);
    match dd::pow_abs(a, b) {
        Some((m, k)) => Exact::Value(if negative { m.neg() } else { m }, k),
        None => {
            let huge = (a.abs() > 1.0) == (b > 0.0);
            match (huge, negative) {
                (true, n) => Exact::Inf { negative: n },
                (false, n) => Exact::Zero { negative: n },
            }
        }
    }
}

/// Pairs for pow: positive bases over the whole range against exponents
/// in [-2, 2], [-40, 40] and a few special ones, negative bases with
/// integer exponents, and the special cases.
fn pow_pairs<T: Float>() -> (Vec<T>, Vec<T>) {
    let (count, bases) = match T::BITS {
        16 => (0, strided_range::<T>(0.0, f64::MAX, 1 << 15)),
        32 => (1 << 19, strided_range::<T>(0.0, f64::MAX, 1 << 12)),
        _ => (1 << 18, strided_range::<T>(0.0, f64::MAX, 1 << 11)),
    };
    let mut a = Vec::new();
    let mut b = Vec::new();
    let mut seed = 0x853c_49e6_748f_ea9bu64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 11) as f64 / (1u64 << 53) as f64
    };
    // Every base against fixed exponents.
    for &x in &bases {
        for y in [0.5, -0.5, 2.0, -1.0, 3.0, 1.0 / 3.0, 0.1, -7.25] {
            a.push(x);
            b.push(T::from_f64(y));
        }
    }
    // Random pairs: bases near 1 and anywhere, exponents small and large.
    for i in 0..count {
        let base = if i % 2 == 0 {
            0.5 + next() * 1.5
        } else {
            bases[(next() * bases.len() as f64) as usize].to_f64()
        };
        let exponent = match i % 3 {
            0 => next() * 4.0 - 2.0,
            1 => next() * 80.0 - 40.0,
            _ => (next() * 60.0 - 30.0).round(),
        };
        a.push(T::from_f64(base));
        b.push(T::from_f64(exponent));
    }
    // Negative bases with integer exponents (sign by parity).
    for i in 0..(bases.len() * 4) {
        let x = bases[i % bases.len()];
        a.push(T::from_f64(-x.to_f64()));
        b.push(T::from_f64((i % 9) as f64 - 4.0));
    }
    // Specials against specials.
    let sp = specials::<T>();
    let extra: Vec<T> = [0.5, 2.0, 3.0, -3.0, -2.0, -0.5, 1.5]
        .into_iter()
        .map(T::from_f64)
        .collect();
    for &x in sp.iter().chain(&extra) {
        for &y in sp.iter().chain(&extra) {
            a.push(x);
            b.push(y);
        }
    }
    (a, b)
}

fn pow_measure<T: Float>() -> Measured {
    let cpu = Device::cpu();
    let (a, b) = pow_pairs::<T>();
    let ta = Tensor::from_slice(&a, &[a.len()], &cpu).unwrap();
    let tb = Tensor::from_slice(&b, &[b.len()], &cpu).unwrap();
    let got = ta.pow(&tb).to_vec().unwrap();
    let mut m = Measured {
        max: 0.0,
        at: String::new(),
        points: a.len(),
    };
    for i in 0..a.len() {
        let exact = pow_exact(a[i].to_f64(), b[i].to_f64());
        let e = ulp_error(got[i].to_f64(), exact, T::FORMAT);
        if e > m.max {
            m.max = e;
            m.at = format!("pow({:?}, {:?}) -> {:?}", a[i], b[i], got[i]);
        }
    }
    m
}

#[test]
fn pow_accuracy() {
    let results = [
        ("f32", pow_measure::<f32>(), NARROW_BOUND),
        ("f64", pow_measure::<f64>(), f64_bound("pow")),
        ("f16", pow_measure::<f16>(), NARROW_BOUND),
        ("bf16", pow_measure::<bf16>(), NARROW_BOUND),
    ];
    report("pow", &results);
}
