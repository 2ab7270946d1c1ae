//! Reference versions of the reductions (sum, mean, max, min, prod),
//! arg-reductions and (log-)softmax: flat `f64` vectors plus dimensions,
//! visiting elements one at a time with explicit index arithmetic.

use stagecraft_ops::ReduceOp;

/// The multi-index of flat position `flat` in a tensor of `dims`.
fn unravel(mut flat: usize, dims: &[usize]) -> Vec<usize> {
    let mut index = vec![0; dims.len()];
    for axis in (0..dims.len()).rev() {
        index[axis] = flat % dims[axis];
        flat /= dims[axis];
    }
    index
}

/// The flat position of multi-index `index` in a tensor of `dims`.
fn ravel(index: &[usize], dims: &[usize]) -> usize {
    index
        .iter()
        .zip(dims)
        .fold(0, |flat, (&i, &d)| flat * d + i)
}

/// Dimensions after reducing `axes` (kept as 1 with `keepdim`).
fn reduced_dims(dims: &[usize], axes: &[usize], keepdim: bool) -> Vec<usize> {
    (0..dims.len())
        .filter_map(|i| match (axes.contains(&i), keepdim) {
            (true, true) => Some(1),
            (true, false) => None,
            (false, _) => Some(dims[i]),
        })
        .collect()
}

/// Where input multi-index `index` lands in the output of a reduction over
/// `axes` (kept dims only; the output's own keepdim 1s do not matter for
/// the flat position).
fn output_position(index: &[usize], dims: &[usize], axes: &[usize]) -> usize {
    let mut flat = 0;
    for (axis, (&i, &d)) in index.iter().zip(dims).enumerate() {
        if !axes.contains(&axis) {
            flat = flat * d + i;
        }
    }
    flat
}

/// NaN-propagating larger of two values.
fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// NaN-propagating smaller of two values.
fn nan_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.min(b)
    }
}

/// `op` of `x` (of `dims`) over the resolved `axes`; returns the values
/// (in f64, not rounded) and the output dimensions.
pub fn reduce(
    op: ReduceOp,
    x: &[f64],
    dims: &[usize],
    axes: &[usize],
    keepdim: bool,
) -> (Vec<f64>, Vec<usize>) {
    let out_dims = reduced_dims(dims, axes, keepdim);
    let out_len: usize = out_dims.iter().product();
    let init = match op {
        ReduceOp::Sum | ReduceOp::Mean => 0.0,
        ReduceOp::Prod => 1.0,
        ReduceOp::Max => f64::NEG_INFINITY,
        ReduceOp::Min => f64::INFINITY,
    };
    let mut out = vec![init; out_len];
    for (flat, &v) in x.iter().enumerate() {
        let index = unravel(flat, dims);
        let o = &mut out[output_position(&index, dims, axes)];
        *o = match op {
            ReduceOp::Sum | ReduceOp::Mean => *o + v,
            ReduceOp::Prod => *o * v,
            ReduceOp::Max => nan_max(*o, v),
            ReduceOp::Min => nan_min(*o, v),
        };
    }
    if op == ReduceOp::Mean {
        let count: usize = axes.iter().map(|&a| dims[a]).product();
        for o in &mut out {
            *o /= count as f64;
        }
    }
    (out, out_dims)
}

/// Index of the largest (`max`) or smallest value along `axis`: the first
/// on ties, and the first NaN if there is one. Returns the indices (as f64)
/// and the output dimensions.
pub fn arg_reduce(
    max: bool,
    x: &[f64],
    dims: &[usize],
    axis: usize,
    keepdim: bool,
) -> (Vec<f64>, Vec<usize>) {
    let out_dims = reduced_dims(dims, &[axis], keepdim);
    let out_len: usize = out_dims.iter().product();
    let mut kept = dims.to_vec();
    kept[axis] = 1;
    let out = (0..out_len)
        .map(|o| {
            let mut index = unravel(o, &kept);
            let mut best: Option<(usize, f64)> = None;
            for i in 0..dims[axis] {
                index[axis] = i;
                let v = x[ravel(&index, dims)];
                best = match best {
                    None => Some((i, v)),
                    Some((_, b)) if b.is_nan() => best,
                    Some(_) if v.is_nan() => Some((i, v)),
                    Some((_, b)) if (max && v > b) || (!max && v < b) => Some((i, v)),
                    keep => keep,
                };
            }
            best.map_or(0.0, |(i, _)| i as f64)
        })
        .collect();
    (out, out_dims)
}

/// Softmax (or, with `log`, log-softmax) of `x` along `axis`, computed as
/// `exp(x - max) / Σ exp(x - max)` (or `x - max - ln Σ exp(x - max)`).
pub fn softmax(x: &[f64], dims: &[usize], axis: usize, log: bool) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    let mut kept = dims.to_vec();
    kept[axis] = 1;
    let lanes: usize = kept.iter().product();
    for lane in 0..lanes {
        let mut index = unravel(lane, &kept);
        let positions: Vec<usize> = (0..dims[axis])
            .map(|i| {
                index[axis] = i;
                ravel(&index, dims)
            })
            .collect();
        let max = positions
            .iter()
            .fold(f64::NEG_INFINITY, |m, &p| nan_max(m, x[p]));
        let sum: f64 = positions.iter().map(|&p| (x[p] - max).exp()).sum();
        for &p in &positions {
            out[p] = if log {
                x[p] - max - sum.ln()
            } else {
                (x[p] - max).exp() / sum
            };
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_cases() {
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(
            reduce(ReduceOp::Sum, &x, &[2, 3], &[1], false),
            (vec![6.0, 15.0], vec![2])
        );
        assert_eq!(
            reduce(ReduceOp::Max, &x, &[2, 3], &[0], true),
            (vec![4.0, 5.0, 6.0], vec![1, 3])
        );
        assert_eq!(
            reduce(ReduceOp::Prod, &x, &[2, 3], &[0, 1], false).0,
            vec![720.0]
        );
        assert!(reduce(ReduceOp::Mean, &[], &[0], &[0], false).0[0].is_nan());
        assert_eq!(
            arg_reduce(true, &[1.0, 3.0, 3.0], &[3], 0, false).0,
            vec![1.0]
        );
        assert_eq!(
            arg_reduce(false, &[1.0, f64::NAN, f64::NAN], &[3], 0, false).0,
            vec![1.0]
        );
        let s = softmax(&[0.0, 0.0], &[2], 0, false);
        assert_eq!(s, vec![0.5, 0.5]);
        let l = softmax(&[0.0, 0.0], &[1, 2], 1, true);
        assert!((l[0] + std::f64::consts::LN_2).abs() < 1e-15);
    }
}
