//! Reference scaled dot-product attention: the textbook formula with the
//! `T × S` matrices materialized, in f64, one head at a time.
//!
//! `q` is `[heads, t, d]`, `k` `[heads, s, d]`, `v` `[heads, s, dv]`, all
//! row-major. Causal masking keeps key `j` for query `i` when `j ≤ i`
//! (upper-left alignment).

/// Sizes of a reference call.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    /// Independent heads (the product of the leading dimensions).
    pub heads: usize,
    /// Queries per head.
    pub t: usize,
    /// Keys per head.
    pub s: usize,
    /// Query and key size.
    pub d: usize,
    /// Value size.
    pub dv: usize,
}

/// The probabilities `softmax(q·kᵀ·scale + mask)` of one head, `[t, s]`
/// (a row without keys is all zeros), and each row's log-sum-exp (`-∞`
/// without keys).
fn probabilities(q: &[f64], k: &[f64], n: Sizes, causal: bool, scale: f64) -> (Vec<f64>, Vec<f64>) {
    let mut p = vec![0.0; n.t * n.s];
    let mut lse = vec![f64::NEG_INFINITY; n.t];
    for i in 0..n.t {
        let seen = if causal { n.s.min(i + 1) } else { n.s };
        if seen == 0 {
            continue;
        }
        let row = &mut p[i * n.s..(i + 1) * n.s];
        for (j, score) in row.iter_mut().enumerate().take(seen) {
            let dot: f64 = (0..n.d).map(|c| q[i * n.d + c] * k[j * n.d + c]).sum();
            *score = dot * scale;
        }
        let max = row[..seen].iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
        let sum: f64 = row[..seen].iter().map(|&x| (x - max).exp()).sum();
        for x in row[..seen].iter_mut() {
            *x = (*x - max).exp() / sum;
        }
        lse[i] = max + sum.ln();
    }
    (p, lse)
}

/// `(O, L)`: `O = softmax(q·kᵀ·scale + mask)·v` (`[heads, t, dv]`) and the
/// log-sum-exp of each row's scores (`[heads, t]`).
pub fn attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    n: Sizes,
    causal: bool,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; n.heads * n.t * n.dv];
    let mut lse = Vec::with_capacity(n.heads * n.t);
    for h in 0..n.heads {
        let (qh, kh, vh) = (
            &q[h * n.t * n.d..][..n.t * n.d],
            &k[h * n.s * n.d..][..n.s * n.d],
            &v[h * n.s * n.dv..][..n.s * n.dv],
        );
        let (p, l) = probabilities(qh, kh, n, causal, scale);
        let oh = &mut out[h * n.t * n.dv..][..n.t * n.dv];
        for i in 0..n.t {
            for e in 0..n.dv {
                oh[i * n.dv + e] = (0..n.s).map(|j| p[i * n.s + j] * vh[j * n.dv + e]).sum();
            }
        }
        lse.extend(l);
    }
    (out, lse)
}

/// `(dq, dk, dv)` for the incoming gradient `g` of `O`, from the
/// materialized probabilities: `dv = Pᵀ·g`, `dP = g·vᵀ`,
/// `dS = P ∘ (dP − rowsum(P ∘ dP))` (the softmax's Jacobian, written
/// without the forward output), `dq = dS·k·scale`, `dk = dSᵀ·q·scale`.
pub fn attention_grad(
    g: &[f64],
    q: &[f64],
    k: &[f64],
    v: &[f64],
    n: Sizes,
    causal: bool,
    scale: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut dq = vec![0.0; n.heads * n.t * n.d];
    let mut dk = vec![0.0; n.heads * n.s * n.d];
    let mut dv = vec![0.0; n.heads * n.s * n.dv];
    for h in 0..n.heads {
        let (qh, kh, vh) = (
            &q[h * n.t * n.d..][..n.t * n.d],
            &k[h * n.s * n.d..][..n.s * n.d],
            &v[h * n.s * n.dv..][..n.s * n.dv],
        );
        let gh = &g[h * n.t * n.dv..][..n.t * n.dv];
        let (p, _) = probabilities(qh, kh, n, causal, scale);
        let mut ds = vec![0.0; n.t * n.s];
        for i in 0..n.t {
            let dp: Vec<f64> = (0..n.s)
                .map(|j| (0..n.dv).map(|e| gh[i * n.dv + e] * vh[j * n.dv + e]).sum())
                .collect();
            let centre: f64 = (0..n.s).map(|j| p[i * n.s + j] * dp[j]).sum();
            for j in 0..n.s {
                ds[i * n.s + j] = p[i * n.s + j] * (dp[j] - centre);
            }
        }
        let dqh = &mut dq[h * n.t * n.d..][..n.t * n.d];
        for i in 0..n.t {
            for c in 0..n.d {
                dqh[i * n.d + c] = scale
                    * (0..n.s)
                        .map(|j| ds[i * n.s + j] * kh[j * n.d + c])
                        .sum::<f64>();
            }
        }
        let dkh = &mut dk[h * n.s * n.d..][..n.s * n.d];
        for j in 0..n.s {
            for c in 0..n.d {
                dkh[j * n.d + c] = scale
                    * (0..n.t)
                        .map(|i| ds[i * n.s + j] * qh[i * n.d + c])
                        .sum::<f64>();
            }
        }
        let dvh = &mut dv[h * n.s * n.dv..][..n.s * n.dv];
        for j in 0..n.s {
            for e in 0..n.dv {
                dvh[j * n.dv + e] = (0..n.t).map(|i| p[i * n.s + j] * gh[i * n.dv + e]).sum();
            }
        }
    }
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two keys with scores 0 and ln 3: weights 1/4 and 3/4; causal, the
    /// first query sees only the first key; no keys at all give zeros.
    #[test]
    fn small_cases_by_hand() {
        let n = Sizes {
            heads: 1,
            t: 2,
            s: 2,
            d: 1,
            dv: 1,
        };
        let q = [1.0, 1.0];
        let k = [0.0, 3f64.ln()];
        let v = [4.0, 8.0];
        let (o, l) = attention(&q, &k, &v, n, false, 1.0);
        assert!((o[0] - 7.0).abs() < 1e-12 && (o[1] - 7.0).abs() < 1e-12);
        assert!((l[0] - 4f64.ln()).abs() < 1e-12);
        let (o, l) = attention(&q, &k, &v, n, true, 1.0);
        assert_eq!(o[0], 4.0);
        assert_eq!(l[0], 0.0);
        assert!((o[1] - 7.0).abs() < 1e-12);
        let empty = Sizes { s: 0, ..n };
        let (o, l) = attention(&q, &[], &[], empty, false, 1.0);
        assert_eq!(o, [0.0, 0.0]);
        assert_eq!(l, [f64::NEG_INFINITY; 2]);
    }

    /// The gradient against central differences of `Σ w·O`.
    #[test]
    fn gradient_matches_finite_differences() {
        let n = Sizes {
            heads: 2,
            t: 3,
            s: 4,
            d: 2,
            dv: 3,
        };
        let wave = |len: usize, seed: f64| -> Vec<f64> {
            (0..len).map(|i| ((i as f64 + seed) * 1.7).sin()).collect()
        };
        let q = wave(n.heads * n.t * n.d, 0.3);
        let k = wave(n.heads * n.s * n.d, 1.1);
        let v = wave(n.heads * n.s * n.dv, 2.9);
        let w = wave(n.heads * n.t * n.dv, 4.2);
        for causal in [false, true] {
            let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
                let (o, _) = attention(q, k, v, n, causal, 0.7);
                o.iter().zip(&w).map(|(o, w)| o * w).sum()
            };
            let (dq, dk, dv) = attention_grad(&w, &q, &k, &v, n, causal, 0.7);
            let h = 1e-6;
            for (which, analytic) in [(0, &dq), (1, &dk), (2, &dv)] {
                for (i, &want) in analytic.iter().enumerate() {
                    let mut inputs = [q.clone(), k.clone(), v.clone()];
                    inputs[which][i] += h;
                    let up = loss(&inputs[0], &inputs[1], &inputs[2]);
                    inputs[which][i] -= 2.0 * h;
                    let down = loss(&inputs[0], &inputs[1], &inputs[2]);
                    let numeric = (up - down) / (2.0 * h);
                    assert!(
                        (numeric - want).abs() < 1e-7,
                        "input {which}[{i}], causal {causal}: {want} vs {numeric}"
                    );
                }
            }
        }
    }
}
