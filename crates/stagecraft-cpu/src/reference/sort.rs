//! Reference sorting: every lane copied out with its positions, sorted by
//! the standard library's stable sort, and written back. Values are f64
//! (exact for the integers the tests use).

use std::cmp::Ordering;

/// `(outer, n, inner)` around `axis`.
fn split3(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        dims[..axis].iter().product(),
        dims[axis],
        dims[axis + 1..].iter().product(),
    )
}

/// Ascending with every NaN after every number.
fn nan_last(a: f64, b: f64) -> Ordering {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        (false, false) => a.partial_cmp(&b).unwrap(),
    }
}

/// The first `k` entries of each lane of `x` (of `dims`) along `axis` in
/// stable sorted order (descending or not), with their positions; with
/// `sorted == false` the `k` entries are put back in position order.
pub fn top_k(
    x: &[f64],
    dims: &[usize],
    axis: usize,
    k: usize,
    descending: bool,
    sorted: bool,
) -> (Vec<f64>, Vec<i64>) {
    let (outer, n, inner) = split3(dims, axis);
    let mut values = vec![0.0; outer * k * inner];
    let mut indices = vec![0i64; outer * k * inner];
    for o in 0..outer {
        for i in 0..inner {
            let mut lane: Vec<(usize, f64)> =
                (0..n).map(|j| (j, x[(o * n + j) * inner + i])).collect();
            lane.sort_by(|a, b| {
                if descending {
                    nan_last(b.1, a.1)
                } else {
                    nan_last(a.1, b.1)
                }
            });
            lane.truncate(k);
            if !sorted {
                lane.sort_by_key(|&(j, _)| j);
            }
            for (j, &(position, value)) in lane.iter().enumerate() {
                values[(o * k + j) * inner + i] = value;
                indices[(o * k + j) * inner + i] = position as i64;
            }
        }
    }
    (values, indices)
}
