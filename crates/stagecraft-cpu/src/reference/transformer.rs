//! Reference embedding, layer and RMS norm and cross-entropy, in f64, one
//! row at a time, written from the definitions rather than from the fused
//! kernels: statistics by plain sums, the norms' backward through each
//! row's explicit Jacobian (O(D²) per row), the loss's backward from an
//! explicit softmax and one-hot row.

use stagecraft_ops::LossReduction;

/// The rows of a `[rows, width]` table the ids pick, `None` if an id is
/// not a row.
pub fn embedding(table: &[f64], rows: usize, width: usize, ids: &[i64]) -> Option<Vec<f64>> {
    let mut out = Vec::with_capacity(ids.len() * width);
    for &id in ids {
        let row = usize::try_from(id).ok().filter(|&r| r < rows)?;
        out.extend_from_slice(&table[row * width..(row + 1) * width]);
    }
    Some(out)
}

/// A norm's outputs.
#[derive(Clone, Debug)]
pub struct Norm {
    /// The normalized rows.
    pub y: Vec<f64>,
    /// Each row's mean (0 for RMS norm).
    pub mean: Vec<f64>,
    /// Each row's `1/sqrt(var + eps)` (`1/sqrt(mean(x²) + eps)` for RMS
    /// norm).
    pub rstd: Vec<f64>,
}

/// The mean and reciprocal standard deviation of one row.
fn row_stats(row: &[f64], eps: f64, centered: bool) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = if centered {
        row.iter().sum::<f64>() / n
    } else {
        0.0
    };
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// Layer norm (`centered`) or RMS norm over rows of `d` elements.
pub fn norm(
    x: &[f64],
    d: usize,
    weight: Option<&[f64]>,
    bias: Option<&[f64]>,
    eps: f64,
    centered: bool,
) -> Norm {
    let mut out = Norm {
        y: Vec::with_capacity(x.len()),
        mean: Vec::new(),
        rstd: Vec::new(),
    };
    for row in x.chunks(d.max(1)).filter(|_| d > 0) {
        let (mean, rstd) = row_stats(row, eps, centered);
        for (j, v) in row.iter().enumerate() {
            let w = weight.map_or(1.0, |w| w[j]);
            let b = bias.map_or(0.0, |b| b[j]);
            out.y.push((v - mean) * rstd * w + b);
        }
        out.mean.push(mean);
        out.rstd.push(rstd);
    }
    out
}

/// A norm's gradients.
#[derive(Clone, Debug)]
pub struct NormGrads {
    /// With respect to the input.
    pub dx: Vec<f64>,
    /// With respect to the weight (summed over rows).
    pub dw: Vec<f64>,
    /// With respect to the bias (summed over rows).
    pub db: Vec<f64>,
}

/// The gradients of [`norm`] for an incoming gradient `g` of `y`:
/// `dx_i = Σ_j g_j·w_j·∂xh_j/∂x_i` with the Jacobian of `xh = (x -
/// mean)·rstd` written out, `∂xh_j/∂x_i = rstd·(δ_ij - 1/D) -
/// rstd³·(x_j - mean)(x_i - mean)/D` (RMS norm: `rstd·δ_ij -
/// rstd³·x_j·x_i/D`).
pub fn norm_backward(
    g: &[f64],
    x: &[f64],
    d: usize,
    weight: Option<&[f64]>,
    eps: f64,
    centered: bool,
) -> NormGrads {
    let mut out = NormGrads {
        dx: vec![0.0; x.len()],
        dw: vec![0.0; d],
        db: vec![0.0; d],
    };
    if d == 0 {
        return out;
    }
    let n = d as f64;
    for (r, row) in x.chunks(d).enumerate() {
        let (mean, rstd) = row_stats(row, eps, centered);
        let gr = &g[r * d..(r + 1) * d];
        for i in 0..d {
            let mut s = 0.0;
            for j in 0..d {
                let delta = if i == j { 1.0 } else { 0.0 };
                let shift = if centered { 1.0 / n } else { 0.0 };
                let jacobian =
                    rstd * (delta - shift) - rstd.powi(3) * (row[j] - mean) * (row[i] - mean) / n;
                s += gr[j] * weight.map_or(1.0, |w| w[j]) * jacobian;
            }
            out.dx[r * d + i] = s;
            out.dw[i] += gr[i] * (row[i] - mean) * rstd;
            out.db[i] += gr[i];
        }
    }
    out
}

/// The loss's outputs.
#[derive(Clone, Debug)]
pub struct Loss {
    /// One loss per row, or the one reduced value.
    pub loss: Vec<f64>,
    /// Each row's log-sum-exp.
    pub lse: Vec<f64>,
}

/// Whether a target is ignored.
fn ignored(t: i64, ignore: Option<i64>) -> bool {
    Some(t) == ignore
}

/// Cross-entropy of rows of `c` logits against `targets`, `None` if a
/// target is neither a class nor ignored.
pub fn cross_entropy(
    logits: &[f64],
    c: usize,
    targets: &[i64],
    ignore: Option<i64>,
    reduction: LossReduction,
) -> Option<Loss> {
    let mut losses = Vec::new();
    let mut lse = Vec::new();
    for (r, &t) in targets.iter().enumerate() {
        let row = &logits[r * c..(r + 1) * c];
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let l = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        lse.push(l);
        if ignored(t, ignore) {
            losses.push(0.0);
            continue;
        }
        let class = usize::try_from(t).ok().filter(|&k| k < c)?;
        // -log softmax(row)[class]
        losses.push(-(row[class] - l));
    }
    let counted = targets.iter().filter(|&&t| !ignored(t, ignore)).count();
    let loss = match reduction {
        LossReduction::None => losses,
        LossReduction::Sum => vec![losses.iter().sum()],
        LossReduction::Mean => vec![losses.iter().sum::<f64>() / counted as f64],
    };
    Some(Loss { loss, lse })
}

/// The gradient of [`cross_entropy`] for an incoming gradient `g` of the
/// loss: `(softmax(row) - one_hot(target))` times the row's share of `g`,
/// 0 for ignored rows.
pub fn cross_entropy_backward(
    logits: &[f64],
    c: usize,
    targets: &[i64],
    ignore: Option<i64>,
    reduction: LossReduction,
    g: &[f64],
) -> Vec<f64> {
    let counted = targets.iter().filter(|&&t| !ignored(t, ignore)).count();
    let mut out = vec![0.0; logits.len()];
    for (r, &t) in targets.iter().enumerate() {
        if ignored(t, ignore) {
            continue;
        }
        let share = match reduction {
            LossReduction::None => g[r],
            LossReduction::Sum => g[0],
            LossReduction::Mean => g[0] / counted as f64,
        };
        let row = &logits[r * c..(r + 1) * c];
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = row.iter().map(|v| (v - max).exp()).collect();
        let total: f64 = exps.iter().sum();
        let one_hot: Vec<f64> = (0..c)
            .map(|k| if k as i64 == t { 1.0 } else { 0.0 })
            .collect();
        for k in 0..c {
            out[r * c + k] = (exps[k] / total - one_hot[k]) * share;
        }
    }
    out
}
