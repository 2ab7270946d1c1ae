//! Reference versions of the training ops, element by element in f64.

use super::creation::philox4x32_10;
use stagecraft_tensor::{DType, Scalar};

fn round_to(dtype: DType, v: f64) -> f64 {
    Scalar::F64(v).cast(dtype).to_f64()
}

/// Inverted dropout of `x` (values of `dtype`) under the key `(seed,
/// offset)`: element `i` takes word `i % 4` of Philox block `offset + i /
/// 4` (every dtype, f64 included), survives when that word's uniform
/// `(word >> 8) / 2^24` is at least `p`, and is then `x·(1/(1-p))`
/// rounded to the dtype; dropped elements are zero.
pub fn dropout(x: &[f64], dtype: DType, seed: u64, offset: u64, p: f64) -> Vec<f64> {
    x.iter()
        .enumerate()
        .map(|(i, &v)| {
            let counter = offset as u128 + (i / 4) as u128;
            let words = philox4x32_10(
                [
                    counter as u32,
                    (counter >> 32) as u32,
                    (counter >> 64) as u32,
                    (counter >> 96) as u32,
                ],
                [seed as u32, (seed >> 32) as u32],
            );
            let u = (words[i % 4] >> 8) as f64 / 2f64.powi(24);
            if u >= p {
                round_to(dtype, v * (1.0 / (1.0 - p)))
            } else {
                0.0
            }
        })
        .collect()
}

/// `Σ x²` over every value of every tensor, summed in f64 in order and
/// rounded once to `dtype`.
pub fn squared_norm(xs: &[&[f64]], dtype: DType) -> f64 {
    let sum: f64 = xs.iter().flat_map(|x| x.iter()).map(|v| v * v).sum();
    round_to(dtype, sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropout_by_hand() {
        // p = 0 keeps everything unscaled; p = 1 drops everything.
        let x = [1.5, -2.0, 0.25, 3.0, 7.0];
        assert_eq!(dropout(&x, DType::F64, 9, 4, 0.0), x.to_vec());
        assert_eq!(dropout(&x, DType::F64, 9, 4, 1.0), vec![0.0; 5]);
        // p = 0.5: survivors doubled.
        let half = dropout(&x, DType::F64, 9, 4, 0.5);
        for (y, v) in half.iter().zip(&x) {
            assert!(*y == 0.0 || *y == 2.0 * v, "{y} from {v}");
        }
    }

    #[test]
    fn squared_norm_by_hand() {
        assert_eq!(squared_norm(&[&[3.0], &[4.0, 0.0], &[]], DType::F64), 25.0);
        assert_eq!(
            squared_norm(&[&[0.1]], DType::F32),
            (0.1f64 * 0.1) as f32 as f64
        );
    }
}
