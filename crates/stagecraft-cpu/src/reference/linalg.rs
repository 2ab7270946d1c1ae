//! Reference matrix product: NumPy `matmul` semantics with explicit index
//! arithmetic, in f64.

/// `a @ b` for row-major values with the given dimensions; returns the values
/// and dimensions of the result. Vectors are promoted as in NumPy. Panics on
/// incompatible shapes (tests only pass valid ones).
pub fn matmul(a: &[f64], a_dims: &[usize], b: &[f64], b_dims: &[usize]) -> (Vec<f64>, Vec<usize>) {
    let a_vec = a_dims.len() == 1;
    let b_vec = b_dims.len() == 1;
    let a_full: Vec<usize> = if a_vec {
        vec![1, a_dims[0]]
    } else {
        a_dims.to_vec()
    };
    let b_full: Vec<usize> = if b_vec {
        vec![b_dims[0], 1]
    } else {
        b_dims.to_vec()
    };
    let (m, k) = (a_full[a_full.len() - 2], a_full[a_full.len() - 1]);
    let (k2, n) = (b_full[b_full.len() - 2], b_full[b_full.len() - 1]);
    assert_eq!(k, k2, "contraction mismatch");
    let ab = &a_full[..a_full.len() - 2];
    let bb = &b_full[..b_full.len() - 2];
    let rank = ab.len().max(bb.len());
    let dim = |d: &[usize], i: usize| -> usize {
        let off = rank - d.len();
        if i < off {
            1
        } else {
            d[i - off]
        }
    };
    // Broadcasting: a 1 takes the other side's size (which may be 0).
    let batch: Vec<usize> = (0..rank)
        .map(|i| {
            if dim(ab, i) == 1 {
                dim(bb, i)
            } else {
                dim(ab, i)
            }
        })
        .collect();
    let items: usize = batch.iter().product();
    let mut out = vec![0.0; items * m * n];
    for item in 0..items {
        // Decompose the batch index, then map it into each operand's batch.
        let mut idx = vec![0; rank];
        let mut rest = item;
        for i in (0..rank).rev() {
            idx[i] = rest % batch[i];
            rest /= batch[i];
        }
        let flat = |d: &[usize]| -> usize {
            let off = rank - d.len();
            let mut f = 0;
            for (j, &dj) in d.iter().enumerate() {
                let ix = if dj == 1 { 0 } else { idx[j + off] };
                f = f * dj + ix;
            }
            f
        };
        let (ia, ib) = (flat(ab), flat(bb));
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for p in 0..k {
                    s += a[ia * m * k + i * k + p] * b[ib * k * n + p * n + j];
                }
                out[item * m * n + i * n + j] = s;
            }
        }
    }
    let mut dims = batch;
    if !a_vec {
        dims.push(m);
    }
    if !b_vec {
        dims.push(n);
    }
    (out, dims)
}
