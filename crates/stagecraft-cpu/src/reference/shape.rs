//! Reference versions of the shape and indexing ops (reshape, transpose,
//! broadcast, concat, slice, gather, one-hot, pad, nonzero): flat `f64`
//! vectors plus dimensions, with every element located by explicit
//! multi-index arithmetic.

use stagecraft_ops::AxisSlice;
use stagecraft_tensor::{Error, ErrorKind, Result};

/// Row-major strides of `dims`.
pub(crate) fn strides_of(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    strides
}

/// The multi-index of flat position `flat` in a tensor of `dims`.
pub(crate) fn unravel(mut flat: usize, dims: &[usize]) -> Vec<usize> {
    let mut index = vec![0; dims.len()];
    for axis in (0..dims.len()).rev() {
        index[axis] = flat % dims[axis];
        flat /= dims[axis];
    }
    index
}

/// The flat position of multi-index `index` in a tensor of `dims`.
pub(crate) fn ravel(index: &[usize], dims: &[usize]) -> usize {
    index.iter().zip(strides_of(dims)).map(|(i, s)| i * s).sum()
}

pub(crate) fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// Permutes axes: output axis `i` is input axis `perm[i]`. Returns the
/// values and the output dimensions.
pub fn transpose(x: &[f64], dims: &[usize], perm: &[usize]) -> (Vec<f64>, Vec<usize>) {
    let out_dims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let out = (0..numel(&out_dims))
        .map(|flat| {
            let out_index = unravel(flat, &out_dims);
            let mut in_index = vec![0; dims.len()];
            for (i, &p) in perm.iter().enumerate() {
                in_index[p] = out_index[i];
            }
            x[ravel(&in_index, dims)]
        })
        .collect();
    (out, out_dims)
}

/// Broadcasts `x` of `dims` to `target` (NumPy rules; assumed valid).
pub fn broadcast_to(x: &[f64], dims: &[usize], target: &[usize]) -> Vec<f64> {
    let lead = target.len() - dims.len();
    (0..numel(target))
        .map(|flat| {
            let out_index = unravel(flat, target);
            let in_index: Vec<usize> = (0..dims.len())
                .map(|i| if dims[i] == 1 { 0 } else { out_index[lead + i] })
                .collect();
            x[ravel(&in_index, dims)]
        })
        .collect()
}

/// Joins `(values, dims)` pairs along `axis`.
pub fn concat(inputs: &[(Vec<f64>, Vec<usize>)], axis: usize) -> (Vec<f64>, Vec<usize>) {
    let mut out_dims = inputs[0].1.clone();
    out_dims[axis] = inputs.iter().map(|(_, d)| d[axis]).sum();
    let out = (0..numel(&out_dims))
        .map(|flat| {
            let mut index = unravel(flat, &out_dims);
            let mut which = 0;
            while index[axis] >= inputs[which].1[axis] {
                index[axis] -= inputs[which].1[axis];
                which += 1;
            }
            inputs[which].0[ravel(&index, &inputs[which].1)]
        })
        .collect();
    (out, out_dims)
}

/// Takes elements `start + k * step` for `k < len` on every axis.
pub fn slice(x: &[f64], dims: &[usize], slices: &[AxisSlice]) -> (Vec<f64>, Vec<usize>) {
    let out_dims: Vec<usize> = slices.iter().map(|s| s.len).collect();
    let out = (0..numel(&out_dims))
        .map(|flat| {
            let out_index = unravel(flat, &out_dims);
            let in_index: Vec<usize> = out_index
                .iter()
                .zip(slices)
                .map(|(&k, s)| s.start + k * s.step)
                .collect();
            x[ravel(&in_index, dims)]
        })
        .collect();
    (out, out_dims)
}

/// Selects entries of `x` along `axis` by `indices` (negative ones count
/// from the end). Out-of-range indices are an `Index` error.
pub fn gather(
    x: &[f64],
    dims: &[usize],
    indices: &[i64],
    index_dims: &[usize],
    axis: usize,
) -> Result<(Vec<f64>, Vec<usize>)> {
    let size = dims[axis] as i64;
    for (position, &i) in indices.iter().enumerate() {
        if i < -size || i >= size {
            return Err(Error::new(
                ErrorKind::Index,
                format!("index {i} at position {position} is outside [-{size}, {size})"),
            ));
        }
    }
    let mut out_dims = dims[..axis].to_vec();
    out_dims.extend_from_slice(index_dims);
    out_dims.extend_from_slice(&dims[axis + 1..]);
    let index_rank = index_dims.len();
    let out = (0..numel(&out_dims))
        .map(|flat| {
            let out_index = unravel(flat, &out_dims);
            let which = &out_index[axis..axis + index_rank];
            let i = indices[ravel(which, index_dims)];
            let i = if i < 0 { i + size } else { i } as usize;
            let mut in_index = out_index[..axis].to_vec();
            in_index.push(i);
            in_index.extend_from_slice(&out_index[axis + index_rank..]);
            x[ravel(&in_index, dims)]
        })
        .collect();
    Ok((out, out_dims))
}

/// One-hot encodes `indices` into `depth` classes (shape `index_dims ++
/// [depth]`); an index outside `0..depth` is an `Index` error.
pub fn one_hot(indices: &[i64], depth: usize) -> Result<Vec<f64>> {
    let mut out = vec![0.0; indices.len() * depth];
    for (position, &i) in indices.iter().enumerate() {
        if i < 0 || i >= depth as i64 {
            return Err(Error::new(
                ErrorKind::Index,
                format!("index {i} at position {position} is outside [0, {depth})"),
            ));
        }
        out[position * depth + i as usize] = 1.0;
    }
    Ok(out)
}

/// Pads with `value`: `pads` holds `(before, after)` per axis.
pub fn pad(x: &[f64], dims: &[usize], pads: &[usize], value: f64) -> (Vec<f64>, Vec<usize>) {
    let out_dims: Vec<usize> = dims
        .iter()
        .enumerate()
        .map(|(i, &d)| d + pads[2 * i] + pads[2 * i + 1])
        .collect();
    let out = (0..numel(&out_dims))
        .map(|flat| {
            let out_index = unravel(flat, &out_dims);
            let mut in_index = Vec::with_capacity(dims.len());
            for (i, &o) in out_index.iter().enumerate() {
                if o < pads[2 * i] || o >= pads[2 * i] + dims[i] {
                    return value;
                }
                in_index.push(o - pads[2 * i]);
            }
            x[ravel(&in_index, dims)]
        })
        .collect();
    (out, out_dims)
}

/// Row-major coordinates of the nonzero elements (NaN is nonzero), flat
/// `[count, rank]`, and the count.
pub fn nonzero(x: &[f64], dims: &[usize]) -> (Vec<i64>, usize) {
    let mut coords = Vec::new();
    let mut count = 0;
    for (flat, &v) in x.iter().enumerate() {
        if v != 0.0 {
            count += 1;
            coords.extend(unravel(flat, dims).into_iter().map(|i| i as i64));
        }
    }
    (coords, count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_cases_by_hand() {
        let x = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(
            transpose(&x, &[2, 3], &[1, 0]).0,
            vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
        );
        assert_eq!(
            broadcast_to(&[7.0, 8.0], &[2, 1], &[2, 2]),
            vec![7.0, 7.0, 8.0, 8.0]
        );
        let (c, d) = concat(
            &[(vec![1.0, 2.0], vec![2, 1]), (vec![3.0, 4.0], vec![2, 1])],
            1,
        );
        assert_eq!((c, d), (vec![1.0, 3.0, 2.0, 4.0], vec![2, 2]));
        let s = AxisSlice {
            start: 1,
            step: 2,
            len: 1,
        };
        let all = AxisSlice {
            start: 0,
            step: 1,
            len: 2,
        };
        assert_eq!(slice(&x, &[3, 2], &[s, all]).0, vec![2.0, 3.0]);
        assert_eq!(
            gather(&x, &[3, 2], &[-1, 0], &[2], 0).unwrap().0,
            vec![4.0, 5.0, 0.0, 1.0]
        );
        assert!(gather(&x, &[3, 2], &[3], &[1], 0).is_err());
        assert_eq!(one_hot(&[1, 0], 2).unwrap(), vec![0.0, 1.0, 1.0, 0.0]);
        assert_eq!(pad(&[1.0], &[1], &[1, 2], 9.0).0, vec![9.0, 1.0, 9.0, 9.0]);
        assert_eq!(
            nonzero(&[0.0, 2.0, f64::NAN, 0.0], &[2, 2]),
            (vec![0, 1, 1, 0], 2)
        );
    }
}
