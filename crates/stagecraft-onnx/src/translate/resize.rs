//! `Resize` and `Upsample`: nearest, linear and cubic interpolation, one
//! axis at a time. The source positions and weights of every output
//! position are computed while translating (they depend on shapes only),
//! then each tap is a `Gather` along the axis, scaled and summed.

use super::{axis, dims, Ctx, Translate};
use crate::error::{OnnxError, Result};
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::DenseHostTensor;

pub(super) fn lookup(op_type: &str) -> Option<Translate> {
    Some(match op_type {
        "Resize" => resize,
        "Upsample" => upsample,
        "GridSample" => grid_sample,
        _ => return None,
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Nearest,
    Linear,
    Cubic,
}

/// How an axis is resampled.
struct Plan<'a> {
    mode: Mode,
    coordinate: &'a str,
    nearest: &'a str,
    cubic_a: f64,
    exclude_outside: bool,
    /// Per axis, the crop `(start, end)` of `tf_crop_and_resize` (in
    /// normalized input coordinates); empty in the other modes.
    roi: Vec<(f64, f64)>,
    /// The value of positions whose crop coordinate falls outside the
    /// input (`tf_crop_and_resize`).
    extrapolation: f64,
    /// Whether a downscaling linear or cubic filter is widened by the
    /// inverse scale (`antialias`).
    antialias: bool,
}

fn upsample(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    let scales: Vec<f64> = if c.opset < 9 {
        c.node
            .attribute
            .iter()
            .find(|a| a.name() == "scales")
            .map(|a| a.floats.iter().map(|&f| f as f64).collect())
            .unwrap_or_default()
    } else {
        known_floats(c, 1)?.unwrap_or_default()
    };
    let mode = parse_mode(&c.attr_str("mode", "nearest"))?;
    let plan = Plan {
        mode,
        coordinate: "asymmetric",
        nearest: "floor",
        cubic_a: -0.75,
        exclude_outside: false,
        roi: Vec::new(),
        extrapolation: 0.0,
        antialias: false,
    };
    let out: Vec<usize> = d
        .iter()
        .zip(&scales)
        .map(|(&n, &s)| (n as f64 * s).floor() as usize)
        .collect();
    Ok(vec![apply(c, &x, &out, &scales, &plan)?])
}

fn parse_mode(mode: &str) -> Result<Mode> {
    match mode {
        "nearest" => Ok(Mode::Nearest),
        "linear" | "bilinear" => Ok(Mode::Linear),
        "cubic" | "bicubic" => Ok(Mode::Cubic),
        other => Err(OnnxError::unsupported(format!("Resize mode {other}"))),
    }
}

/// A known float input as f64s; `None` when absent or empty.
fn known_floats(c: &Ctx<'_>, i: usize) -> Result<Option<Vec<f64>>> {
    if c.opt_input(i).is_none() {
        return Ok(None);
    }
    let t = c.known(i).ok_or_else(|| {
        OnnxError::unsupported(format!(
            "input {i} of {} is computed while the model runs; it must be a constant",
            c.op_type()
        ))
    })?;
    let v: Vec<f64> = (0..t.numel())
        .filter_map(|j| t.get_scalar(j).map(super::scalar_f64))
        .collect();
    Ok((!v.is_empty()).then_some(v))
}

fn resize(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    let rank = d.len();
    let mode_name = c.attr_str("mode", "nearest");
    let mode = parse_mode(&mode_name)?;
    let coordinate = if c.opset < 11 {
        "asymmetric".to_string()
    } else {
        c.attr_str("coordinate_transformation_mode", "half_pixel")
    };
    let nearest = if c.opset < 11 {
        "floor".to_string()
    } else {
        c.attr_str("nearest_mode", "round_prefer_floor")
    };
    let axes: Vec<usize> = match c.attr_ints("axes") {
        Some(a) => a.iter().map(|&a| axis(a, rank)).collect::<Result<_>>()?,
        None => (0..rank).collect(),
    };
    let (scales, sizes) = if c.opset < 11 {
        (known_floats(c, 1)?, None)
    } else {
        (
            known_floats(c, 2)?,
            c.known_ints(3)?.filter(|s| !s.is_empty()),
        )
    };
    let mut full_scales = vec![1.0; rank];
    let mut out = d.clone();
    match (sizes, scales) {
        (Some(sizes), _) => {
            if sizes.len() != axes.len() {
                return Err(OnnxError::invalid("Resize sizes do not match the axes"));
            }
            let policy = c.attr_str("keep_aspect_ratio_policy", "stretch");
            let ratios: Vec<f64> = axes
                .iter()
                .zip(&sizes)
                .map(|(&a, &s)| s as f64 / d[a] as f64)
                .collect();
            let common = match policy.as_str() {
                "stretch" => None,
                "not_larger" => Some(ratios.iter().copied().fold(f64::INFINITY, f64::min)),
                "not_smaller" => Some(ratios.iter().copied().fold(0.0, f64::max)),
                other => {
                    return Err(OnnxError::invalid(format!(
                        "keep_aspect_ratio_policy {other}"
                    )))
                }
            };
            for (i, &a) in axes.iter().enumerate() {
                match common {
                    None => {
                        out[a] = sizes[i].max(0) as usize;
                        full_scales[a] = ratios[i];
                    }
                    Some(s) => {
                        out[a] = (s * d[a] as f64).round() as usize;
                        full_scales[a] = s;
                    }
                }
            }
        }
        (None, Some(scales)) => {
            if scales.len() != axes.len() {
                return Err(OnnxError::invalid("Resize scales do not match the axes"));
            }
            for (i, &a) in axes.iter().enumerate() {
                full_scales[a] = scales[i];
                out[a] = (d[a] as f64 * scales[i]).floor() as usize;
            }
        }
        (None, None) => return Err(OnnxError::invalid("Resize needs scales or sizes")),
    }
    let roi = if coordinate == "tf_crop_and_resize" {
        let r = known_floats(c, 1)?
            .ok_or_else(|| OnnxError::invalid("tf_crop_and_resize needs a roi"))?;
        if r.len() != 2 * axes.len() {
            return Err(OnnxError::invalid(format!(
                "roi of {} values for {} axes",
                r.len(),
                axes.len()
            )));
        }
        let mut full = vec![(0.0, 1.0); rank];
        for (i, &a) in axes.iter().enumerate() {
            full[a] = (r[i], r[axes.len() + i]);
        }
        full
    } else {
        Vec::new()
    };
    let plan = Plan {
        mode,
        coordinate: &coordinate,
        nearest: &nearest,
        cubic_a: c.attr_float("cubic_coeff_a", -0.75) as f64,
        exclude_outside: c.attr_int("exclude_outside", 0) != 0,
        roi,
        extrapolation: c.attr_float("extrapolation_value", 0.0) as f64,
        antialias: c.attr_int("antialias", 0) != 0,
    };
    Ok(vec![apply(c, &x, &out, &full_scales, &plan)?])
}

/// The source coordinate of output position `x` on an axis of `n` inputs
/// resized to `m` with `scale`.
fn source(coordinate: &str, x: f64, n: usize, m: usize, scale: f64) -> Result<f64> {
    // ONNX measures the resized length as `n · scale`, unrounded.
    let resized = n as f64 * scale;
    Ok(match coordinate {
        "half_pixel" => (x + 0.5) / scale - 0.5,
        "pytorch_half_pixel" => {
            if resized > 1.0 {
                (x + 0.5) / scale - 0.5
            } else {
                0.0
            }
        }
        "align_corners" => {
            if resized == 1.0 {
                0.0
            } else {
                x * (n as f64 - 1.0) / (resized - 1.0)
            }
        }
        "asymmetric" => x / scale,
        "tf_half_pixel_for_nn" => (x + 0.5) / scale,
        "half_pixel_symmetric" => {
            let adjustment = m as f64 / (scale * n as f64);
            let center = n as f64 / 2.0;
            let offset = center * (1.0 - adjustment);
            offset + (x + 0.5) / scale - 0.5
        }
        other => {
            return Err(OnnxError::unsupported(format!(
                "Resize coordinate_transformation_mode {other}"
            )))
        }
    })
}

fn cubic_weights(t: f64, a: f64) -> [f64; 4] {
    let far = |s: f64| ((a * s - 5.0 * a) * s + 8.0 * a) * s - 4.0 * a;
    let near = |s: f64| ((a + 2.0) * s - (a + 3.0)) * s * s + 1.0;
    [far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)]
}

/// The taps of one axis: for each tap, the source index and weight of
/// every output position.
/// With a crop (`roi`, `tf_crop_and_resize`), positions whose source lies
/// outside the input get no taps and are flagged in the second result.
#[allow(clippy::type_complexity)]
fn taps(
    plan: &Plan<'_>,
    n: usize,
    m: usize,
    scale: f64,
    roi: Option<(f64, f64)>,
) -> Result<(Vec<(Vec<i64>, Vec<f64>)>, Vec<bool>)> {
    let last = n as i64 - 1;
    let clamp = |i: i64| i.clamp(0, last);
    let widened = plan.antialias && plan.mode != Mode::Nearest && scale < 1.0;
    let reach = if plan.mode == Mode::Linear { 1.0 } else { 2.0 };
    // The first tap offset of the widened filter, and the tap count.
    let start = (-reach / scale).floor() as i64 + 1;
    let k = match plan.mode {
        _ if widened => (2 - 2 * start) as usize,
        Mode::Nearest => 1,
        Mode::Linear => 2,
        Mode::Cubic => 4,
    };
    let mut out = vec![(Vec::with_capacity(m), Vec::with_capacity(m)); k];
    let mut outside = Vec::with_capacity(m);
    for o in 0..m {
        outside.push(false);
        let s = match roi {
            Some((start, end)) => {
                let span = (n - 1) as f64;
                let s = if m > 1 {
                    start * span + o as f64 * (end - start) * span / (m - 1) as f64
                } else {
                    0.5 * (start + end) * span
                };
                if s < 0.0 || s > span {
                    if let Some(flag) = outside.last_mut() {
                        *flag = true;
                    }
                    for tap in out.iter_mut() {
                        tap.0.push(0);
                        tap.1.push(0.0);
                    }
                    continue;
                }
                s
            }
            None => source(plan.coordinate, o as f64, n, m, scale)?,
        };
        if widened {
            // The filter stretched by 1/scale: taps at floor(s) + i for
            // every i whose scaled distance is inside the kernel's
            // support, weights normalized to sum to 1; taps past the
            // edges read the edge (or are dropped with exclude_outside).
            let base = s.floor();
            let ratio = s - base;
            let count = k;
            let a = plan.cubic_a;
            let kernel = |x: f64| -> f64 {
                let x = x.abs();
                if plan.mode == Mode::Linear {
                    (1.0 - x).max(0.0)
                } else if x <= 1.0 {
                    ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
                } else {
                    0.0
                }
            };
            let mut idx = Vec::with_capacity(count);
            let mut w = Vec::with_capacity(count);
            for j in 0..count {
                let i = start + j as i64;
                let at = base as i64 + i;
                let mut v = kernel((i as f64 - ratio) * scale);
                if plan.exclude_outside && (at < 0 || at > last) {
                    v = 0.0;
                }
                idx.push(clamp(at));
                w.push(v);
            }
            let total: f64 = w.iter().sum();
            if total != 0.0 {
                w.iter_mut().for_each(|v| *v /= total);
            }
            for (j, tap) in out.iter_mut().enumerate() {
                tap.0.push(idx[j]);
                tap.1.push(w[j]);
            }
            continue;
        }
        match plan.mode {
            Mode::Nearest => {
                let i = match plan.nearest {
                    "round_prefer_floor" => {
                        if s.fract() == 0.5 {
                            s.floor()
                        } else {
                            s.round()
                        }
                    }
                    "round_prefer_ceil" => {
                        if s.fract() == 0.5 {
                            s.ceil()
                        } else {
                            s.round()
                        }
                    }
                    "floor" => s.floor(),
                    "ceil" => s.ceil(),
                    other => {
                        return Err(OnnxError::unsupported(format!(
                            "Resize nearest_mode {other}"
                        )))
                    }
                };
                out[0].0.push(clamp(i as i64));
                out[0].1.push(1.0);
            }
            Mode::Linear => {
                let s = s.clamp(0.0, last as f64);
                let i0 = s.floor();
                let t = s - i0;
                out[0].0.push(clamp(i0 as i64));
                out[0].1.push(1.0 - t);
                out[1].0.push(clamp(i0 as i64 + 1));
                out[1].1.push(t);
            }
            Mode::Cubic => {
                let i0 = s.floor();
                let t = s - i0;
                let mut w = cubic_weights(t, plan.cubic_a);
                let idx: Vec<i64> = (0..4).map(|j| i0 as i64 - 1 + j).collect();
                if plan.exclude_outside {
                    for j in 0..4 {
                        if idx[j] < 0 || idx[j] > last {
                            w[j] = 0.0;
                        }
                    }
                    let total: f64 = w.iter().sum();
                    if total != 0.0 {
                        w.iter_mut().for_each(|v| *v /= total);
                    }
                }
                for j in 0..4 {
                    out[j].0.push(clamp(idx[j]));
                    out[j].1.push(w[j]);
                }
            }
        }
    }
    Ok((out, outside))
}

fn apply(
    c: &Ctx<'_>,
    x: &TensorHandle,
    out: &[usize],
    scales: &[f64],
    plan: &Plan<'_>,
) -> Result<TensorHandle> {
    let d = dims(x);
    if out.len() != d.len() || scales.len() != d.len() {
        return Err(OnnxError::invalid(format!(
            "Resize of a rank-{} tensor with {} scales",
            d.len(),
            scales.len()
        )));
    }
    if plan.mode != Mode::Nearest && !x.dtype().is_float() {
        return Err(OnnxError::unsupported(format!(
            "{} interpolation of {} tensors",
            if plan.mode == Mode::Linear {
                "linear"
            } else {
                "cubic"
            },
            x.dtype()
        )));
    }
    let mut y = x.clone();
    for a in 0..d.len() {
        let (n, m) = (d[a], out[a]);
        if n == 0 || scales[a] <= 0.0 {
            return Err(OnnxError::invalid(format!(
                "Resize axis {a}: {n} inputs, scale {}",
                scales[a]
            )));
        }
        let (taps, outside) = taps(plan, n, m, scales[a], plan.roi.get(a).copied())?;
        let identity = !outside.contains(&true)
            && n == m
            && taps.iter().all(|(idx, w)| {
                w.iter().all(|&w| w == 0.0 || w == 1.0)
                    && idx
                        .iter()
                        .zip(w)
                        .enumerate()
                        .all(|(o, (&i, &w))| w == 0.0 || i == o as i64)
            });
        if identity {
            continue;
        }
        let mut g = OpAttrs::new();
        g.set_int("axis", a as i64);
        let mut wshape = vec![1; d.len()];
        wshape[a] = m;
        let mut acc: Option<TensorHandle> = None;
        for (idx, w) in taps {
            if w.iter().all(|&v| v == 0.0) {
                continue;
            }
            let indices = c.ints_constant(&idx)?;
            let picked = c.op1(&ops::GATHER, &[y.clone(), indices], &g)?;
            let term = if w.iter().all(|&v| v == 1.0) {
                picked
            } else {
                let wt = DenseHostTensor::from_slice(&w, wshape.as_slice())?;
                let wt = c.cast(&c.constant(wt), x.dtype())?;
                c.binary(&ops::MUL, &picked, &wt)?
            };
            acc = Some(match acc {
                Some(a) => c.binary(&ops::ADD, &a, &term)?,
                None => term,
            });
        }
        if outside.contains(&true) {
            // Positions cropped outside the input take the extrapolation
            // value (their taps all weigh 0).
            let fill: Vec<f64> = outside
                .iter()
                .map(|&o| if o { plan.extrapolation } else { 0.0 })
                .collect();
            let ft = DenseHostTensor::from_slice(&fill, wshape.as_slice())?;
            let ft = c.cast(&c.constant(ft), x.dtype())?;
            acc = Some(match acc {
                Some(a) => c.binary(&ops::ADD, &a, &ft)?,
                None => {
                    let mut shape = dims(&y);
                    shape[a] = m;
                    let mut b = OpAttrs::new();
                    b.set_dims("shape", &shape);
                    c.op1(&ops::BROADCAST_TO, &[ft], &b)?
                }
            });
        }
        y = acc.ok_or_else(|| OnnxError::invalid("Resize with all-zero weights"))?;
    }
    Ok(y)
}

/// GridSample on 4-D and 5-D inputs with (bi/tri)linear or nearest sampling and zeros
/// or border padding: grid coordinates are unnormalized per
/// `align_corners`, and each sampled corner is a `GatherElements` from the
/// flattened image, weighted (zero where it falls outside under zeros
/// padding).
fn grid_sample(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let grid = c.input(1)?;
    let xd = dims(&x);
    let gd = dims(&grid);
    let r = xd.len().saturating_sub(2);
    if !(2..=3).contains(&r) || gd.len() != r + 2 || gd[r + 1] != r || gd[0] != xd[0] {
        return Err(OnnxError::unsupported(format!(
            "GridSample of a {}-D input with a {gd:?} grid (4-D and 5-D inputs are supported)",
            xd.len()
        )));
    }
    let mode = c.attr_str("mode", if c.opset >= 20 { "linear" } else { "bilinear" });
    let padding = c.attr_str("padding_mode", "zeros");
    let cubic = matches!(mode.as_str(), "cubic" | "bicubic");
    if cubic && (xd.len() != 4 || padding != "zeros") {
        return Err(OnnxError::unsupported(format!(
            "GridSample mode {mode} with padding_mode {padding} or on a {}-D input",
            xd.len()
        )));
    }
    let linear = match mode.as_str() {
        "linear" | "bilinear" => true,
        "nearest" | "cubic" | "bicubic" => false,
        other => return Err(OnnxError::unsupported(format!("GridSample mode {other}"))),
    };
    if !matches!(padding.as_str(), "zeros" | "border" | "reflection") {
        return Err(OnnxError::unsupported(format!(
            "GridSample padding_mode {padding}"
        )));
    }
    let align = c.attr_int("align_corners", 0) != 0;
    let dt = x.dtype();
    let (n, ch) = (xd[0], xd[1]);
    let sizes = &xd[2..];
    let p: usize = gd[1..=r].iter().product();
    let coord = |j: i64, size: usize| -> Result<TensorHandle> {
        let mut a = OpAttrs::new();
        let mut starts = vec![0i64; r + 1];
        starts.push(j);
        let mut ends: Vec<i64> = gd[..=r].iter().map(|&v| v as i64).collect();
        ends.push(j + 1);
        a.set_ints("starts", &starts);
        a.set_ints("ends", &ends);
        let g = c.op1(&ops::SLICE, std::slice::from_ref(&grid), &a)?;
        let g = c.cast(&c.reshape(&g, &[n, 1, p])?, dt)?;
        // align_corners: -1 and 1 are the centers of the corner pixels;
        // otherwise their outer edges.
        let s = size as f64;
        let v = if align {
            let g = c.with_scalar(&ops::ADD, &g, 1.0)?;
            c.with_scalar(&ops::MUL, &g, (s - 1.0) / 2.0)?
        } else {
            let g = c.with_scalar(&ops::ADD, &g, 1.0)?;
            let g = c.with_scalar(&ops::MUL, &g, s / 2.0)?;
            c.with_scalar(&ops::SUB, &g, 0.5)?
        };
        match padding.as_str() {
            "border" => {
                let v = c.with_scalar(&ops::MAXIMUM, &v, 0.0)?;
                c.with_scalar(&ops::MINIMUM, &v, s - 1.0)
            }
            "reflection" => {
                // Reflect into [lo, hi] (the corner centers, or the outer
                // edges), as often as needed, then keep inside the image.
                let (lo, hi) = if align {
                    (0.0, s - 1.0)
                } else {
                    (-0.5, s - 0.5)
                };
                let span = hi - lo;
                let v = if span <= 0.0 {
                    c.with_scalar(&ops::MUL, &v, 0.0)?
                } else {
                    let d = c.unary(&ops::ABS, &c.with_scalar(&ops::SUB, &v, lo)?)?;
                    let flips = c.unary(&ops::FLOOR, &c.with_scalar(&ops::DIV, &d, span)?)?;
                    let extra =
                        c.binary(&ops::SUB, &d, &c.with_scalar(&ops::MUL, &flips, span)?)?;
                    let half = c.unary(&ops::FLOOR, &c.with_scalar(&ops::MUL, &flips, 0.5)?)?;
                    let odd =
                        c.binary(&ops::SUB, &flips, &c.with_scalar(&ops::MUL, &half, 2.0)?)?;
                    let even = c.binary(&ops::EQUAL, &odd, &c.scalar(0.0, dt)?)?;
                    let up = c.with_scalar(&ops::ADD, &extra, lo)?;
                    let down = c.binary(&ops::SUB, &c.scalar(span + lo, dt)?, &extra)?;
                    c.op1(&ops::SELECT, &[even, up, down], &OpAttrs::new())?
                };
                let v = c.with_scalar(&ops::MAXIMUM, &v, 0.0)?;
                c.with_scalar(&ops::MINIMUM, &v, s - 1.0)
            }
            _ => Ok(v),
        }
    };
    // The grid's last axis lists x (the last spatial dim) first.
    let coords: Vec<TensorHandle> = (0..r)
        .map(|k| coord((r - 1 - k) as i64, sizes[k]))
        .collect::<Result<_>>()?;
    let total: usize = sizes.iter().product();
    let flat = c.reshape(&x, &[n, ch, total])?;
    let mut b = OpAttrs::new();
    b.set_dims("shape", &[n, ch, p]);
    // The value at integer coordinates (float tensors, one per spatial
    // dim), zero outside the image.
    let sample = |at: &[TensorHandle]| -> Result<TensorHandle> {
        let mut ok: Option<TensorHandle> = None;
        let mut lin: Option<TensorHandle> = None;
        for (k, v) in at.iter().enumerate() {
            let size = sizes[k] as f64;
            let zero = c.scalar(0.0, dt)?;
            let hi = c.scalar(size - 1.0, dt)?;
            let ge = c.binary(&ops::GREATER_EQUAL, v, &zero)?;
            let le = c.binary(&ops::LESS_EQUAL, v, &hi)?;
            let inside = c.binary(&ops::LOGICAL_AND, &ge, &le)?;
            ok = Some(match ok {
                None => inside,
                Some(o) => c.binary(&ops::LOGICAL_AND, &o, &inside)?,
            });
            let cv = c.with_scalar(&ops::MAXIMUM, v, 0.0)?;
            let cv = c.with_scalar(&ops::MINIMUM, &cv, size - 1.0)?;
            lin = Some(match lin {
                None => cv,
                Some(l) => {
                    let l = c.with_scalar(&ops::MUL, &l, size)?;
                    c.binary(&ops::ADD, &l, &cv)?
                }
            });
        }
        let (ok, lin) = match (ok, lin) {
            (Some(o), Some(l)) => (o, l),
            _ => return Err(OnnxError::invalid("GridSample without spatial dims")),
        };
        let lin = c.cast(&lin, stagecraft_tensor::DType::I64)?;
        let lin = c.op1(&ops::BROADCAST_TO, &[lin], &b)?;
        let mut g = OpAttrs::new();
        g.set_int("axis", 2);
        let v = c.op1(&ops::GATHER_ELEMENTS, &[flat.clone(), lin], &g)?;
        let zero = c.scalar(0.0, dt)?;
        let ok = c.op1(&ops::BROADCAST_TO, &[ok], &b)?;
        c.op1(&ops::SELECT, &[ok, v, zero], &OpAttrs::new())
    };
    let y = if cubic {
        // Keys' cubic convolution (A = -0.75) over the 4 x 4 neighbors.
        let a = -0.75;
        let mut taps = Vec::new();
        for v in &coords {
            let lo = c.unary(&ops::FLOOR, v)?;
            let t = c.binary(&ops::SUB, v, &lo)?;
            // |d| in (1, 2): ((a|d| - 5a)|d| + 8a)|d| - 4a; |d| <= 1:
            // ((a + 2)|d| - (a + 3))|d|^2 + 1.
            let far = |d: &TensorHandle| -> Result<TensorHandle> {
                let e = c.with_scalar(&ops::MUL, d, a)?;
                let e = c.with_scalar(&ops::SUB, &e, 5.0 * a)?;
                let e = c.binary(&ops::MUL, &e, d)?;
                let e = c.with_scalar(&ops::ADD, &e, 8.0 * a)?;
                let e = c.binary(&ops::MUL, &e, d)?;
                c.with_scalar(&ops::SUB, &e, 4.0 * a)
            };
            let near = |d: &TensorHandle| -> Result<TensorHandle> {
                let e = c.with_scalar(&ops::MUL, d, a + 2.0)?;
                let e = c.with_scalar(&ops::SUB, &e, a + 3.0)?;
                let e = c.binary(&ops::MUL, &e, d)?;
                let e = c.binary(&ops::MUL, &e, d)?;
                c.with_scalar(&ops::ADD, &e, 1.0)
            };
            let one = c.scalar(1.0, dt)?;
            let two = c.scalar(2.0, dt)?;
            let t1 = c.with_scalar(&ops::ADD, &t, 1.0)?;
            let u = c.binary(&ops::SUB, &one, &t)?;
            let u1 = c.binary(&ops::SUB, &two, &t)?;
            let weights = [far(&t1)?, near(&t)?, near(&u)?, far(&u1)?];
            let mut row = Vec::new();
            for (k, w) in weights.into_iter().enumerate() {
                let at = c.with_scalar(&ops::ADD, &lo, k as f64 - 1.0)?;
                row.push((at, w));
            }
            taps.push(row);
        }
        let mut acc: Option<TensorHandle> = None;
        for (yv, wy) in &taps[0] {
            for (xv, wx) in &taps[1] {
                let v = sample(&[yv.clone(), xv.clone()])?;
                let wgt = c.binary(&ops::MUL, wy, wx)?;
                let t = c.binary(&ops::MUL, &v, &wgt)?;
                acc = Some(match acc {
                    None => t,
                    Some(a) => c.binary(&ops::ADD, &a, &t)?,
                });
            }
        }
        acc.ok_or_else(|| OnnxError::invalid("no taps"))?
    } else if linear {
        let one = c.scalar(1.0, dt)?;
        // Per dim: (low corner, high corner, low weight, high weight).
        let mut parts = Vec::new();
        for v in &coords {
            let lo = c.unary(&ops::FLOOR, v)?;
            let hi = c.with_scalar(&ops::ADD, &lo, 1.0)?;
            let w_hi = c.binary(&ops::SUB, v, &lo)?;
            let w_lo = c.binary(&ops::SUB, &one, &w_hi)?;
            parts.push((lo, hi, w_lo, w_hi));
        }
        let mut acc: Option<TensorHandle> = None;
        for corner in 0..(1usize << r) {
            let mut at = Vec::with_capacity(r);
            let mut wgt: Option<TensorHandle> = None;
            for (k, (lo, hi, w_lo, w_hi)) in parts.iter().enumerate() {
                let high = corner >> k & 1 == 1;
                at.push(if high { hi.clone() } else { lo.clone() });
                let wk = if high { w_hi } else { w_lo };
                wgt = Some(match wgt {
                    None => wk.clone(),
                    Some(wv) => c.binary(&ops::MUL, &wv, wk)?,
                });
            }
            let v = sample(&at)?;
            let wgt = wgt.ok_or_else(|| OnnxError::invalid("no corner weight"))?;
            let t = c.binary(&ops::MUL, &v, &wgt)?;
            acc = Some(match acc {
                None => t,
                Some(a) => c.binary(&ops::ADD, &a, &t)?,
            });
        }
        acc.ok_or_else(|| OnnxError::invalid("no corners"))?
    } else {
        // Nearest rounds half to even, like nearbyint.
        let at: Vec<TensorHandle> = coords
            .iter()
            .map(|v| c.unary(&ops::ROUND, v))
            .collect::<Result<_>>()?;
        sample(&at)?
    };
    let mut out = vec![n, ch];
    out.extend_from_slice(&gd[1..=r]);
    Ok(vec![c.reshape(&y, &out)?])
}
