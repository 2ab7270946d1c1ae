//! Reference versions of the creation ops (fill, arange and the
//! Philox-4x32-10 random streams), computed one element at a time in `f64`
//! from the documented formulas, as the oracle for the fast kernels.
//!
//! The random stream layout is specified on
//! `crate::kernels::creation` (and repeated in [`random_uniform`]); this
//! module re-derives every element independently from `(seed, offset, i)`.

use stagecraft_ops::arange_len;
use stagecraft_tensor::{DType, Result, Scalar};

/// Rounds `v` to `dtype` and back (the `Cast` rules).
fn round_to(dtype: DType, v: f64) -> f64 {
    Scalar::F64(v).cast(dtype).to_f64()
}

/// `count` elements all equal to `value` (as f64).
pub fn fill(value: Scalar, count: usize) -> Vec<f64> {
    vec![value.to_f64(); count]
}

/// `start + i * step` for every `i < arange_len(start, stop, step)`, each
/// rounded to `dtype`.
pub fn arange(start: f64, stop: f64, step: f64, dtype: DType) -> Result<Vec<f64>> {
    let n = arange_len(start, stop, step)?;
    Ok((0..n)
        .map(|i| round_to(dtype, start + i as f64 * step))
        .collect())
}

/// Philox-4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers:
/// as easy as 1, 2, 3", SC 2011) of a 128-bit counter (four 32-bit words,
/// least significant first) under a 64-bit key (two words).
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(0x9E37_79B9);
            k[1] = k[1].wrapping_add(0xBB67_AE85);
        }
        let p0 = 0xD251_1F53u64 * c[0] as u64;
        let p1 = 0xCD9E_8D57u64 * c[2] as u64;
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The four words of Philox block `block` of the stream `(seed, offset)`:
/// counter `offset + block` as a 128-bit integer, key = the seed's low and
/// high 32 bits.
fn block_words(seed: u64, offset: u64, block: u64) -> [u32; 4] {
    let counter = offset as u128 + block as u128;
    let words = [
        counter as u32,
        (counter >> 32) as u32,
        (counter >> 64) as u32,
        (counter >> 96) as u32,
    ];
    philox4x32_10(words, [seed as u32, (seed >> 32) as u32])
}

/// Elements per Philox block: four for 32-bit-or-narrower dtypes (one word
/// each), two for f64 (two words each).
fn per_block(dtype: DType) -> u64 {
    if dtype == DType::F64 {
        2
    } else {
        4
    }
}

/// The uniform draw in `[0, 1)` of element `i`; for `closed_above`, the
/// variant in `(0, 1]` (Box–Muller's radius) instead.
fn unit(words: &[u32; 4], dtype: DType, lane: usize, closed_above: bool) -> f64 {
    let extra = if closed_above { 1.0 } else { 0.0 };
    if dtype == DType::F64 {
        let bits = (words[2 * lane] as u64 | (words[2 * lane + 1] as u64) << 32) >> 11;
        (bits as f64 + extra) / 2f64.powi(53)
    } else {
        ((words[lane] >> 8) as f64 + extra) / 2f64.powi(24)
    }
}

/// The value of `dtype` next to `v` (itself a `dtype` value), upwards or
/// downwards.
fn step_value(dtype: DType, v: f64, up: bool) -> f64 {
    let s = Scalar::F64(v).cast(dtype);
    let bits = s.to_bits();
    let negative = v < 0.0 || (v == 0.0 && v.is_sign_negative());
    let sign_bit = 1u64 << (dtype.size_in_bytes() * 8 - 1);
    let next = if v == 0.0 {
        // Zero of either sign steps to the smallest subnormal of the sign
        // it moves towards.
        if up {
            1
        } else {
            sign_bit | 1
        }
    } else if up != negative {
        bits + 1
    } else {
        bits - 1
    };
    Scalar::from_bits(dtype, next).to_f64()
}

/// Uniform values in `[low, high)` of `dtype`, element `i` a function of
/// `(seed, offset, i)` only:
///
/// * f32, f16, bf16: element `i` takes word `i % 4` of block `i / 4`,
///   `u = (word >> 8) / 2^24`;
/// * f64: element `i` takes words `2l`, `2l+1` (low, high half of a u64)
///   of block `i / 2` with `l = i % 2`, `u = (u64 >> 11) / 2^53`;
///
/// then `low + u * (high - low)` in f64 (`low * (1 - u) + high * u` when
/// `high - low` overflows), rounded to the dtype and moved to the nearest
/// dtype value inside `[low, high)` if rounding left the interval.
pub fn random_uniform(
    seed: u64,
    offset: u64,
    count: usize,
    dtype: DType,
    low: f64,
    high: f64,
) -> Vec<f64> {
    let e = per_block(dtype);
    let mut lowest = round_to(dtype, low);
    if lowest < low {
        lowest = step_value(dtype, lowest, true);
    }
    let mut highest = round_to(dtype, high);
    if highest >= high {
        highest = step_value(dtype, highest, false);
    }
    (0..count as u64)
        .map(|i| {
            let words = block_words(seed, offset, i / e);
            let u = unit(&words, dtype, (i % e) as usize, false);
            let v = if (high - low).is_finite() {
                low + u * (high - low)
            } else {
                low * (1.0 - u) + high * u
            };
            round_to(dtype, v).max(lowest).min(highest)
        })
        .collect()
}

/// Normal values `mean + std * z`, element `i` a function of
/// `(seed, offset, i)` only: Box–Muller on a pair `(u1, u2)` with
/// `u1 ∈ (0, 1]`, `u2 ∈ [0, 1)`, `r = sqrt(-2 ln u1)`, giving `r cos(2π u2)`
/// then `r sin(2π u2)`:
///
/// * f32, f16, bf16: block `i / 4`; the pair for lane `l = i % 4` is words
///   `(2(l/2), 2(l/2)+1)` with 24-bit uniforms, `u1 = ((w >> 8) + 1) / 2^24`;
///   even lanes take the cosine, odd ones the sine;
/// * f64: block `i / 2`; `u1` from words 0,1 and `u2` from words 2,3 (53-bit
///   uniforms, `u1 = ((u64 >> 11) + 1) / 2^53`); lane 0 takes the cosine,
///   lane 1 the sine.
pub fn random_normal(
    seed: u64,
    offset: u64,
    count: usize,
    dtype: DType,
    mean: f64,
    std: f64,
) -> Vec<f64> {
    let e = per_block(dtype);
    (0..count as u64)
        .map(|i| {
            let words = block_words(seed, offset, i / e);
            let lane = (i % e) as usize;
            let (u1, u2) = if dtype == DType::F64 {
                (unit(&words, dtype, 0, true), unit(&words, dtype, 1, false))
            } else {
                let pair = lane / 2;
                (
                    unit(&words, dtype, 2 * pair, true),
                    unit(&words, dtype, 2 * pair + 1, false),
                )
            };
            let r = (-2.0 * u1.ln()).sqrt();
            let theta = 2.0 * std::f64::consts::PI * u2;
            let z = if lane & 1 == 0 {
                r * theta.cos()
            } else {
                r * theta.sin()
            };
            round_to(dtype, mean + std * z)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }

    #[test]
    fn neighbours_and_ranges() {
        assert_eq!(step_value(DType::F16, 1.0, false), 1.0 - 1.0 / 2048.0);
        assert_eq!(step_value(DType::F32, 1.0, true), 1.0 + f32::EPSILON as f64);
        assert_eq!(
            step_value(DType::F64, -1.0, true),
            -1.0 + f64::EPSILON / 2.0
        );
        let v = random_uniform(1, 0, 1000, DType::BF16, -1.0, 1.0);
        assert!(v.iter().all(|&x| (-1.0..1.0).contains(&x)));
        assert_eq!(
            arange(0.0, 1.0, 0.25, DType::F32).unwrap(),
            vec![0.0, 0.25, 0.5, 0.75]
        );
        assert_eq!(fill(Scalar::I32(3), 2), vec![3.0, 3.0]);
    }
}
