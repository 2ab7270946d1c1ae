//! Reference version of the scans: flat `f64` vectors plus dimensions.

use super::shape::{numel, ravel, unravel};

/// Running sums along `axis`, each output summed from scratch over the
/// elements it covers (in the order the scan visits them): `x[0..=i]`,
/// `x[0..i]` when `exclusive`, `x[i..]` or `x[i+1..]` when `reverse`.
pub fn cumsum(x: &[f64], dims: &[usize], axis: usize, exclusive: bool, reverse: bool) -> Vec<f64> {
    let n = dims[axis];
    (0..numel(dims))
        .map(|flat| {
            let mut at = unravel(flat, dims);
            let i = at[axis];
            let covered: Vec<usize> = match (reverse, exclusive) {
                (false, false) => (0..=i).collect(),
                (false, true) => (0..i).collect(),
                (true, false) => (i..n).rev().collect(),
                (true, true) => (i + 1..n).rev().collect(),
            };
            covered
                .into_iter()
                .map(|j| {
                    at[axis] = j;
                    x[ravel(&at, dims)]
                })
                .fold(0.0, |acc, v| acc + v)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_cases_by_hand() {
        // [[1, 2, 3], [4, 5, 6]]
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(
            cumsum(&x, &[2, 3], 1, false, false),
            vec![1.0, 3.0, 6.0, 4.0, 9.0, 15.0]
        );
        assert_eq!(
            cumsum(&x, &[2, 3], 1, true, false),
            vec![0.0, 1.0, 3.0, 0.0, 4.0, 9.0]
        );
        assert_eq!(
            cumsum(&x, &[2, 3], 1, false, true),
            vec![6.0, 5.0, 3.0, 15.0, 11.0, 6.0]
        );
        assert_eq!(
            cumsum(&x, &[2, 3], 0, true, true),
            vec![4.0, 5.0, 6.0, 0.0, 0.0, 0.0]
        );
    }
}
