//! Reference versions of the element-indexing ops (gather-elements,
//! scatter-add, index-add) and the triangular mask: flat `f64` vectors
//! plus dimensions, every element located by explicit multi-index
//! arithmetic.

use super::shape::{numel, ravel, unravel};
use stagecraft_tensor::{Error, ErrorKind, Result};

/// `indices[position]` resolved against an axis of `size` (negative
/// counts from the end), or an `Index` error.
fn resolve(indices: &[i64], position: usize, size: usize) -> Result<usize> {
    let (i, size) = (indices[position], size as i64);
    if i < -size || i >= size {
        return Err(Error::new(
            ErrorKind::Index,
            format!("index {i} at position {position} is outside [-{size}, {size})"),
        ));
    }
    Ok(if i < 0 { i + size } else { i } as usize)
}

/// `out[p] = x[p with its coordinate on axis replaced by indices[p]]`
/// for every multi-index `p` of `index_dims`.
pub fn gather_elements(
    x: &[f64],
    dims: &[usize],
    indices: &[i64],
    index_dims: &[usize],
    axis: usize,
) -> Result<Vec<f64>> {
    (0..numel(index_dims))
        .map(|position| {
            let mut at = unravel(position, index_dims);
            at[axis] = resolve(indices, position, dims[axis])?;
            Ok(x[ravel(&at, dims)])
        })
        .collect()
}

/// `out = x; out[p with axis coordinate indices[p]] += src[p]` for every
/// multi-index `p` of `index_dims`, in row-major order; `round` rounds
/// each sum to the element type.
pub fn scatter_add(
    x: &[f64],
    dims: &[usize],
    indices: &[i64],
    index_dims: &[usize],
    src: &[f64],
    axis: usize,
    round: &dyn Fn(f64) -> f64,
) -> Result<Vec<f64>> {
    let mut out = x.to_vec();
    // `src` has the shape of the indices: one value per position.
    for (position, &value) in src.iter().enumerate() {
        let mut at = unravel(position, index_dims);
        at[axis] = resolve(indices, position, dims[axis])?;
        let target = ravel(&at, dims);
        out[target] = round(out[target] + value);
    }
    Ok(out)
}

/// `out = x; out[.., indices[k], ..] += src[.., k, ..]` along `axis`, in
/// row-major order of `src`; `round` rounds each sum to the element type.
pub fn index_add(
    x: &[f64],
    dims: &[usize],
    indices: &[i64],
    src: &[f64],
    axis: usize,
    round: &dyn Fn(f64) -> f64,
) -> Result<Vec<f64>> {
    let mut src_dims = dims.to_vec();
    src_dims[axis] = indices.len();
    for position in 0..indices.len() {
        resolve(indices, position, dims[axis])?;
    }
    let mut out = x.to_vec();
    for (flat, &value) in src.iter().enumerate() {
        let mut at = unravel(flat, &src_dims);
        at[axis] = resolve(indices, at[axis], dims[axis])?;
        let target = ravel(&at, dims);
        out[target] = round(out[target] + value);
    }
    Ok(out)
}

/// Keeps element `(.., i, j)` when `j - i <= k` (lower) or `j - i >= k`
/// (upper); zero elsewhere.
pub fn trilu(x: &[f64], dims: &[usize], upper: bool, k: i64) -> Vec<f64> {
    let rank = dims.len();
    (0..x.len())
        .map(|flat| {
            let at = unravel(flat, dims);
            let offset = at[rank - 1] as i128 - at[rank - 2] as i128;
            let keep = if upper {
                offset >= k as i128
            } else {
                offset <= k as i128
            };
            if keep {
                x[flat]
            } else {
                0.0
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_cases_by_hand() {
        // x = [[0, 1, 2], [3, 4, 5]]
        let x = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(
            gather_elements(&x, &[2, 3], &[1, 0, -1, 0], &[2, 2], 0).unwrap(),
            vec![3.0, 1.0, 3.0, 1.0]
        );
        assert!(gather_elements(&x, &[2, 3], &[2], &[1, 1], 0).is_err());
        let same = |v: f64| v;
        // Both src values of row 0 land on column 2, the third on 0.
        assert_eq!(
            scatter_add(
                &x,
                &[2, 3],
                &[2, 2, 0],
                &[1, 3],
                &[10.0, 20.0, 30.0],
                1,
                &same
            )
            .unwrap(),
            vec![30.0, 1.0, 32.0, 3.0, 4.0, 5.0]
        );
        assert_eq!(
            index_add(
                &x,
                &[2, 3],
                &[1, 1],
                &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
                0,
                &same
            )
            .unwrap(),
            vec![0.0, 1.0, 2.0, 8.0, 11.0, 14.0]
        );
        assert!(index_add(&x, &[2, 3], &[-3], &[0.0; 3], 0, &same).is_err());
        assert_eq!(
            trilu(&x, &[2, 3], false, 0),
            vec![0.0, 0.0, 0.0, 3.0, 4.0, 0.0]
        );
        assert_eq!(
            trilu(&x, &[2, 3], true, 1),
            vec![0.0, 1.0, 2.0, 0.0, 0.0, 5.0]
        );
    }
}
