//! Signal-processing ONNX ops: `DFT` and `STFT` as matrix products with
//! generated cosine and sine matrices (so they differentiate and run in
//! every mode like any matmul), and the window generators `HannWindow`,
//! `HammingWindow` and `BlackmanWindow`, whose size must be known before
//! the model runs (it is the output's shape) and whose values are computed
//! on the host, like `MelWeightMatrix`'s.

use super::shape::slice_axis;
use super::{axis, dims, require_float, Ctx, Translate};
use crate::error::{OnnxError, Result};
use crate::tensor::dtype_of;
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::{DType, DenseHostTensor};
use std::f64::consts::PI;

pub(super) fn lookup(op_type: &str) -> Option<Translate> {
    Some(match op_type {
        "DFT" => dft as Translate,
        "STFT" => stft,
        "HannWindow" => |c| window(c, &[0.5, 0.5]),
        "HammingWindow" => |c| window(c, &[25.0 / 46.0, 21.0 / 46.0]),
        "BlackmanWindow" => |c| window(c, &[0.42, 0.5, 0.08]),
        "MelWeightMatrix" => mel_weight_matrix,
        _ => return None,
    })
}

/// A cosine-sum window `Σ_j (-1)^j a_j cos(2πjn / D)` of the known size
/// (input 0), `D` the size when periodic and one less when symmetric.
fn window(c: &Ctx<'_>, coefficients: &[f64]) -> Result<Vec<TensorHandle>> {
    let size = c
        .known_ints(0)?
        .and_then(|v| v.first().copied())
        .ok_or_else(|| OnnxError::invalid(format!("{} needs a size", c.op_type())))?;
    if size < 0 {
        return Err(OnnxError::invalid(format!(
            "window size {size} is negative"
        )));
    }
    let n = size as usize;
    let periodic = c.attr_int("periodic", 1) != 0;
    let denom = if periodic { n as f64 } else { n as f64 - 1.0 };
    let values: Vec<f64> = (0..n)
        .map(|i| {
            coefficients
                .iter()
                .enumerate()
                .map(|(j, a)| {
                    let sign = if j % 2 == 0 { 1.0 } else { -1.0 };
                    // A one-point symmetric window has no period: its one
                    // value is the sum at n = 0.
                    let phase = if denom > 0.0 {
                        2.0 * PI * j as f64 * i as f64 / denom
                    } else {
                        0.0
                    };
                    sign * a * phase.cos()
                })
                .sum()
        })
        .collect();
    let to = dtype_of(c.attr_int("output_datatype", 1) as i32)?;
    let w = c.constant(DenseHostTensor::from_slice(&values, [n])?);
    Ok(vec![c.cast(&w, to)?])
}

/// A `[rows, cols]` matrix of `f(row, col)` as a constant of `dtype`.
fn matrix(
    c: &Ctx<'_>,
    rows: usize,
    cols: usize,
    dtype: DType,
    f: impl Fn(usize, usize) -> f64,
) -> Result<TensorHandle> {
    let values: Vec<f64> = (0..rows)
        .flat_map(|r| (0..cols).map(move |k| (r, k)))
        .map(|(r, k)| f(r, k))
        .collect();
    let m = c.constant(DenseHostTensor::from_slice(&values, [rows, cols])?);
    c.cast(&m, dtype)
}

/// The discrete Fourier transform of length `n` along the last axis of the
/// real part `xr` and optional imaginary part `xi` (both `[..., m]`, `m`
/// at most `n`: missing samples are zeros). Returns the real and imaginary
/// parts, `[..., n]`, or `[..., n/2 + 1]` when `onesided`; the inverse is
/// scaled by `1/n`.
fn dft_last(
    c: &Ctx<'_>,
    xr: &TensorHandle,
    xi: Option<&TensorHandle>,
    n: usize,
    inverse: bool,
    onesided: bool,
) -> Result<(TensorHandle, TensorHandle)> {
    let m = *dims(xr).last().unwrap_or(&0);
    let cols = if onesided { n / 2 + 1 } else { n };
    let dt = xr.dtype();
    let scale = if inverse { 1.0 / n as f64 } else { 1.0 };
    // The angle reduced mod n first keeps it small, so the table is exact
    // to rounding for long transforms too.
    let angle = move |r: usize, k: usize| 2.0 * PI * ((r * k) % n) as f64 / n as f64;
    let cos = matrix(c, m, cols, dt, |r, k| scale * angle(r, k).cos())?;
    let sin = matrix(c, m, cols, dt, |r, k| scale * angle(r, k).sin())?;
    let rc = c.binary(&ops::MATMUL, xr, &cos)?;
    let rs = c.binary(&ops::MATMUL, xr, &sin)?;
    // Forward: e^{-iθ}, so (xr + i·xi)(cos − i·sin); inverse: e^{+iθ}.
    let (yr, yi) = match xi {
        Some(xi) => {
            let ic = c.binary(&ops::MATMUL, xi, &cos)?;
            let is = c.binary(&ops::MATMUL, xi, &sin)?;
            if inverse {
                (
                    c.binary(&ops::SUB, &rc, &is)?,
                    c.binary(&ops::ADD, &ic, &rs)?,
                )
            } else {
                (
                    c.binary(&ops::ADD, &rc, &is)?,
                    c.binary(&ops::SUB, &ic, &rs)?,
                )
            }
        }
        None if inverse => (rc, rs),
        None => (rc, c.unary(&ops::NEG, &rs)?),
    };
    Ok((yr, yi))
}

/// `[..., n]` real and imaginary parts as `[..., n, 2]`.
fn to_complex(c: &Ctx<'_>, yr: &TensorHandle, yi: &TensorHandle) -> Result<TensorHandle> {
    let mut d = dims(yr);
    d.push(1);
    let r = c.reshape(yr, &d)?;
    let i = c.reshape(yi, &d)?;
    let mut a = OpAttrs::new();
    a.set_int("axis", d.len() as i64 - 1);
    c.op1(&ops::CONCAT, &[r, i], &a)
}

/// `[..., m, 1 or 2]` as its real part `[..., m]` and imaginary part.
fn split_complex(c: &Ctx<'_>, x: &TensorHandle) -> Result<(TensorHandle, Option<TensorHandle>)> {
    let d = dims(x);
    let (last, head) = d
        .split_last()
        .ok_or_else(|| OnnxError::invalid("a scalar signal"))?;
    let re = slice_axis(c, x, d.len() - 1, 0, 1)?;
    let re = c.reshape(&re, head)?;
    match last {
        1 => Ok((re, None)),
        2 => {
            let im = slice_axis(c, x, d.len() - 1, 1, 2)?;
            Ok((re, Some(c.reshape(&im, head)?)))
        }
        n => Err(OnnxError::invalid(format!(
            "the last dimension of a signal must be 1 (real) or 2 (complex), got {n}"
        ))),
    }
}

fn transpose(c: &Ctx<'_>, x: &TensorHandle, perm: &[usize]) -> Result<TensorHandle> {
    if perm.iter().enumerate().all(|(i, &p)| i == p) {
        return Ok(x.clone());
    }
    let perm: Vec<i64> = perm.iter().map(|&p| p as i64).collect();
    let mut a = OpAttrs::new();
    a.set_ints("perm", &perm);
    c.op1(&ops::TRANSPOSE, std::slice::from_ref(x), &a)
}

/// `DFT`: the axis (an attribute before opset 20, a known input since) is
/// moved next to the complex dimension, transformed by [`dft_last`] and
/// moved back. `inverse` with `onesided` is the inverse of a real
/// signal's one-sided spectrum: the missing half is the mirror image, so
/// each inner frequency counts twice and the result is real.
fn dft(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let d = dims(&x);
    let rank = d.len();
    if rank < 2 {
        return Err(OnnxError::invalid(format!("DFT input {d:?} has rank < 2")));
    }
    let a = if c.opset >= 20 {
        match c.known_ints(2)? {
            Some(v) => *v
                .first()
                .ok_or_else(|| OnnxError::invalid("DFT axis is empty"))?,
            None => -2,
        }
    } else {
        c.attr_int("axis", 1)
    };
    let a = axis(a, rank)?;
    if a == rank - 1 {
        return Err(OnnxError::invalid(
            "the DFT axis cannot be the complex dimension",
        ));
    }
    let inverse = c.attr_int("inverse", 0) != 0;
    let onesided = c.attr_int("onesided", 0) != 0;
    let given = match c.known_ints(1)? {
        Some(v) => Some(
            *v.first()
                .ok_or_else(|| OnnxError::invalid("DFT dft_length is empty"))?,
        ),
        None => None,
    };
    let real_inverse = inverse && onesided;
    if inverse && !onesided {
        // The reference rounds its inverse transforms in f32 in an order
        // this matrix product does not share; near-zero outputs then
        // differ by more than the conformance tolerance, so the complex
        // inverse is refused rather than answered differently.
        return Err(OnnxError::unsupported(
            "DFT inverse of a complex signal (its f32 rounding differs from the reference's)",
        ));
    }
    let n = match given {
        Some(n) if n < 1 => {
            return Err(OnnxError::invalid(format!(
                "dft_length {n} is not positive"
            )))
        }
        Some(n) => n as usize,
        None if real_inverse => 2 * d[a].saturating_sub(1),
        None => d[a],
    };
    if n == 0 {
        return Err(OnnxError::invalid("DFT of an empty signal"));
    }
    // Move the axis to just before the complex dimension.
    let mut perm: Vec<usize> = (0..rank - 1).filter(|&i| i != a).collect();
    perm.push(a);
    perm.push(rank - 1);
    let mut back = vec![0; rank];
    for (i, &p) in perm.iter().enumerate() {
        back[p] = i;
    }
    let xt = transpose(c, &x, &perm)?;
    let (mut xr, mut xi) = split_complex(c, &xt)?;
    // Samples past the transform's length are dropped; missing ones are
    // zeros, which the matrices' rows simply leave out.
    let keep = if real_inverse { n / 2 + 1 } else { n };
    let m = *dims(&xr).last().unwrap_or(&0);
    if m > keep {
        let last = dims(&xr).len() - 1;
        xr = slice_axis(c, &xr, last, 0, keep)?;
        xi = xi.map(|v| slice_axis(c, &v, last, 0, keep)).transpose()?;
    }
    let y = if real_inverse {
        let rows = m.min(keep);
        let dt = xr.dtype();
        let weight = |k: usize| {
            if k == 0 || (n.is_multiple_of(2) && k == n / 2) {
                1.0
            } else {
                2.0
            }
        };
        let angle = move |k: usize, t: usize| 2.0 * PI * ((k * t) % n) as f64 / n as f64;
        let cos = matrix(c, rows, n, dt, |k, t| {
            weight(k) * angle(k, t).cos() / n as f64
        })?;
        let mut yr = c.binary(&ops::MATMUL, &xr, &cos)?;
        if let Some(xi) = &xi {
            let sin = matrix(c, rows, n, dt, |k, t| {
                weight(k) * angle(k, t).sin() / n as f64
            })?;
            let s = c.binary(&ops::MATMUL, xi, &sin)?;
            yr = c.binary(&ops::SUB, &yr, &s)?;
        }
        let mut od = dims(&yr);
        od.push(1);
        c.reshape(&yr, &od)?
    } else {
        let (yr, yi) = dft_last(c, &xr, xi.as_ref(), n, inverse, onesided)?;
        to_complex(c, &yr, &yi)?
    };
    Ok(vec![transpose(c, &y, &back)?])
}

/// `STFT(signal [B, L, 1 or 2], frame_step, window?, frame_length?)`:
/// frames of the signal `frame_step` apart, each multiplied by the window,
/// transformed by [`dft_last`]: `[B, frames, bins, 2]`.
fn stft(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let d = dims(&x);
    if d.len() != 3 {
        return Err(OnnxError::invalid(format!(
            "STFT signal {d:?} is not [batch, length, 1 or 2]"
        )));
    }
    let step = c
        .known_ints(1)?
        .and_then(|v| v.first().copied())
        .ok_or_else(|| OnnxError::invalid("STFT needs frame_step"))?;
    let window = c.opt_input(2).cloned();
    let frame_len = match (c.known_ints(3)?, &window) {
        (Some(v), _) => *v
            .first()
            .ok_or_else(|| OnnxError::invalid("STFT frame_length is empty"))?,
        (None, Some(w)) => *dims(w).first().unwrap_or(&0) as i64,
        (None, None) => return Err(OnnxError::invalid("STFT needs a window or a frame_length")),
    };
    let len = d[1];
    if step < 1 || frame_len < 1 || frame_len as usize > len {
        return Err(OnnxError::invalid(format!(
            "STFT frame_step {step} and frame_length {frame_len} do not fit a signal of {len}"
        )));
    }
    let (step, fl) = (step as usize, frame_len as usize);
    if let Some(w) = &window {
        if dims(w) != [fl] {
            return Err(OnnxError::invalid(format!(
                "STFT window {:?} is not [{fl}]",
                dims(w)
            )));
        }
    }
    let frames = (len - fl) / step + 1;
    let onesided = c.attr_int("onesided", 1) != 0;
    let (xr, xi) = split_complex(c, &x)?;
    let frame = |v: &TensorHandle| -> Result<TensorHandle> {
        let parts = (0..frames)
            .map(|f| {
                let s = slice_axis(c, v, 1, f * step, f * step + fl)?;
                c.reshape(&s, &[d[0], 1, fl])
            })
            .collect::<Result<Vec<_>>>()?;
        let mut y = if parts.len() == 1 {
            parts[0].clone()
        } else {
            let mut a = OpAttrs::new();
            a.set_int("axis", 1);
            c.op1(&ops::CONCAT, &parts, &a)?
        };
        if let Some(w) = &window {
            let w = c.cast(w, y.dtype())?;
            y = c.binary(&ops::MUL, &y, &w)?;
        }
        Ok(y)
    };
    let fr = frame(&xr)?;
    let fi = xi.as_ref().map(frame).transpose()?;
    let (yr, yi) = dft_last(c, &fr, fi.as_ref(), fl, false, onesided)?;
    Ok(vec![to_complex(c, &yr, &yi)?])
}

/// Input `i` as one known number.
fn known_number(c: &Ctx<'_>, i: usize, what: &str) -> Result<f64> {
    c.known_f64(i)?
        .ok_or_else(|| OnnxError::invalid(format!("MelWeightMatrix needs {what}")))
}

/// `MelWeightMatrix`: `[dft_length/2 + 1, num_mel_bins]` triangular
/// filters with peaks of 1, their edges equally spaced on the mel scale
/// `2595 · log10(1 + f/700)` between the lower and upper edge and mapped
/// to whole spectrogram bins (rounded down), as the reference does.
fn mel_weight_matrix(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let mels = known_number(c, 0, "num_mel_bins")?;
    let dft_len = known_number(c, 1, "dft_length")?;
    let rate = known_number(c, 2, "sample_rate")?;
    let (lo, hi) = (
        known_number(c, 3, "lower_edge_hertz")?,
        known_number(c, 4, "upper_edge_hertz")?,
    );
    if mels < 1.0 || dft_len < 1.0 || rate <= 0.0 {
        return Err(OnnxError::invalid(format!(
            "MelWeightMatrix of {mels} bins, dft_length {dft_len}, sample_rate {rate}"
        )));
    }
    let (mels, dft_len) = (mels as usize, dft_len as i64);
    let bins = (dft_len / 2 + 1) as usize;
    let mel = |f: f64| 2595.0 * (1.0 + f / 700.0).log10();
    let (lo_mel, hi_mel) = (mel(lo), mel(hi));
    let step = (hi_mel - lo_mel) / (mels + 2) as f64;
    let edges: Vec<i64> = (0..mels + 2)
        .map(|i| {
            let hz = 700.0 * (10f64.powf((i as f64 * step + lo_mel) / 2595.0) - 1.0);
            (((dft_len + 1) as f64 * hz) / rate).floor() as i64
        })
        .collect();
    let mut out = vec![0.0f64; bins * mels];
    let mut set = |j: i64, i: usize, v: f64| -> Result<()> {
        if j < 0 || j as usize >= bins {
            return Err(OnnxError::invalid(format!(
                "mel band {i} reaches bin {j}, outside the {bins} spectrogram bins"
            )));
        }
        out[j as usize * mels + i] = v;
        Ok(())
    };
    for i in 0..mels {
        let (left, center, right) = (edges[i], edges[i + 1], edges[i + 2]);
        if center == left {
            set(center, i, 1.0)?;
        } else {
            for j in left..=center {
                set(j, i, (j - left) as f64 / (center - left) as f64)?;
            }
        }
        for j in center..right {
            set(j, i, (right - j) as f64 / (right - center) as f64)?;
        }
    }
    let to = dtype_of(c.attr_int("output_datatype", 1) as i32)?;
    let m = c.constant(DenseHostTensor::from_slice(&out, [bins, mels])?);
    Ok(vec![c.cast(&m, to)?])
}
