//! Vision ONNX ops: `NonMaxSuppression` (computed on the host: its boxes,
//! scores and thresholds must be known before the model runs, so graph
//! inputs feeding them are baked per call), `AffineGrid` (a matmul of the
//! affine matrices with a generated base grid; the size must be known)
//! `Det` of 1×1 to 3×3 matrices (cofactor expansion) and `MaxUnpool` (a
//! scatter-add of the values to their flat indices), and `RoiAlign` (its
//! regions must be known: each region's bilinear samples become a known
//! weight matrix applied to the image with a batched matmul), and
//! `DeformConv` (bilinear samples at the offset positions, gathered per
//! kernel tap, then one matmul per group).

use super::shape::slice_axis;
use super::{dims, require_float, scalar_f64, Ctx, Translate};
use crate::error::{OnnxError, Result};
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::DenseHostTensor;

pub(super) fn lookup(op_type: &str) -> Option<Translate> {
    Some(match op_type {
        "NonMaxSuppression" => non_max_suppression as Translate,
        "AffineGrid" => affine_grid,
        "Det" => det,
        "MaxUnpool" => max_unpool,
        "RoiAlign" => roi_align,
        "DeformConv" => deform_conv,
        _ => return None,
    })
}

/// The known values of input `i` as f64, or an error saying they must be
/// known.
fn known_f64s(c: &Ctx<'_>, i: usize, what: &str) -> Result<Vec<f64>> {
    let t = c.known(i).ok_or_else(|| {
        OnnxError::unsupported(format!(
            "{} needs its {what} (input {i}) known before the model runs; it is computed inside the model",
            c.op_type()
        ))
    })?;
    (0..t.numel())
        .map(|j| {
            t.get_scalar(j)
                .map(scalar_f64)
                .ok_or_else(|| OnnxError::invalid(format!("cannot read input {i}")))
        })
        .collect()
}

/// A box as `(y1, x1, y2, x2)` with `y1 <= y2` and `x1 <= x2`.
fn corners(b: &[f64], center: bool) -> [f64; 4] {
    if center {
        let (xc, yc, w, h) = (b[0], b[1], b[2], b[3]);
        [yc - h / 2.0, xc - w / 2.0, yc + h / 2.0, xc + w / 2.0]
    } else {
        [
            b[0].min(b[2]),
            b[1].min(b[3]),
            b[0].max(b[2]),
            b[1].max(b[3]),
        ]
    }
}

/// Whether two boxes overlap by an intersection over union above
/// `threshold` (boxes without area never suppress).
fn suppresses(a: &[f64; 4], b: &[f64; 4], threshold: f64) -> bool {
    let ih = a[2].min(b[2]) - a[0].max(b[0]);
    let iw = a[3].min(b[3]) - a[1].max(b[1]);
    if ih <= 0.0 || iw <= 0.0 {
        return false;
    }
    let inter = ih * iw;
    let area_a = (a[2] - a[0]) * (a[3] - a[1]);
    let area_b = (b[2] - b[0]) * (b[3] - b[1]);
    if area_a <= 0.0 || area_b <= 0.0 {
        return false;
    }
    let union = area_a + area_b - inter;
    union > 0.0 && inter / union > threshold
}

/// `NonMaxSuppression`: per batch and class, boxes by descending score
/// (ties by index), each kept unless a kept box overlaps it by more than
/// the IoU threshold, at most `max_output_boxes_per_class` of them; only
/// scores above `score_threshold` (when given) are candidates.
fn non_max_suppression(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let boxes = known_f64s(c, 0, "boxes")?;
    let scores = known_f64s(c, 1, "scores")?;
    let (bd, sd) = (dims(&c.input(0)?), dims(&c.input(1)?));
    if bd.len() != 3 || bd[2] != 4 || sd.len() != 3 || sd[0] != bd[0] || sd[2] != bd[1] {
        return Err(OnnxError::invalid(format!(
            "boxes {bd:?} and scores {sd:?} are not [B, N, 4] and [B, C, N]"
        )));
    }
    let max_out = match c.opt_input(2) {
        Some(_) => known_f64s(c, 2, "max_output_boxes_per_class")?
            .first()
            .map_or(0, |&v| v.max(0.0) as usize),
        None => 0,
    };
    let iou = match c.opt_input(3) {
        Some(_) => known_f64s(c, 3, "iou_threshold")?
            .first()
            .copied()
            .unwrap_or(0.0),
        None => 0.0,
    };
    let score_min = match c.opt_input(4) {
        Some(_) => known_f64s(c, 4, "score_threshold")?.first().copied(),
        None => None,
    };
    let center = c.attr_int("center_point_box", 0) != 0;
    let (batches, classes, n) = (sd[0], sd[1], sd[2]);
    let mut out: Vec<i64> = Vec::new();
    for b in 0..batches {
        let bx: Vec<[f64; 4]> = (0..n)
            .map(|i| corners(&boxes[(b * n + i) * 4..(b * n + i) * 4 + 4], center))
            .collect();
        for cl in 0..classes {
            let s = &scores[(b * classes + cl) * n..(b * classes + cl + 1) * n];
            let mut order: Vec<usize> = (0..n)
                .filter(|&i| score_min.is_none_or(|m| s[i] > m))
                .collect();
            order.sort_by(|&p, &q| s[q].total_cmp(&s[p]).then(p.cmp(&q)));
            let mut kept: Vec<usize> = Vec::new();
            for i in order {
                if kept.len() >= max_out {
                    break;
                }
                if kept.iter().all(|&k| !suppresses(&bx[i], &bx[k], iou)) {
                    kept.push(i);
                }
            }
            for k in kept {
                out.extend([b as i64, cl as i64, k as i64]);
            }
        }
    }
    let rows = out.len() / 3;
    Ok(vec![
        c.constant(DenseHostTensor::from_slice(&out, [rows, 3])?)
    ])
}

/// Normalized coordinates of `n` points in `[-1, 1]`: the end points
/// themselves with `align_corners`, else the centers of `n` equal cells.
fn coords(n: usize, align_corners: bool) -> Vec<f64> {
    (0..n)
        .map(|i| {
            if align_corners {
                if n == 1 {
                    0.0
                } else {
                    -1.0 + 2.0 * i as f64 / (n - 1) as f64
                }
            } else {
                (2.0 * i as f64 + 1.0) / n as f64 - 1.0
            }
        })
        .collect()
}

/// `AffineGrid(theta [N, 2, 3] or [N, 3, 4], size)`: the base grid of
/// homogeneous coordinates `(x, y[, z], 1)` (x fastest) times `thetaᵀ`,
/// `[N, H, W, 2]` or `[N, D, H, W, 3]`.
fn affine_grid(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let theta = c.input(0)?;
    require_float(c, &theta)?;
    let size = c
        .known_ints(1)?
        .ok_or_else(|| OnnxError::invalid("AffineGrid needs a size"))?;
    let td = dims(&theta);
    let spatial = size.len().saturating_sub(2);
    if !(spatial == 2 || spatial == 3)
        || td.len() != 3
        || td[1] != spatial
        || td[2] != spatial + 1
        || size[0] as usize != td[0]
        || size.iter().any(|&v| v < 0)
    {
        return Err(OnnxError::invalid(format!(
            "theta {td:?} does not fit size {size:?}"
        )));
    }
    let align = c.attr_int("align_corners", 0) != 0;
    let extent: Vec<usize> = size[2..].iter().map(|&v| v as usize).collect();
    // Per axis, fastest last: (D,) H, W; the point is (x, y[, z], 1).
    let axes: Vec<Vec<f64>> = extent.iter().map(|&n| coords(n, align)).collect();
    let points: usize = extent.iter().product();
    let mut base = Vec::with_capacity(points * (spatial + 1));
    for p in 0..points {
        let mut rest = p;
        let mut idx = vec![0; spatial];
        for a in (0..spatial).rev() {
            idx[a] = rest % extent[a];
            rest /= extent[a];
        }
        for a in (0..spatial).rev() {
            base.push(axes[a][idx[a]]);
        }
        base.push(1.0);
    }
    let base = c.constant(DenseHostTensor::from_slice(&base, [points, spatial + 1])?);
    let base = c.cast(&base, theta.dtype())?;
    let mut a = OpAttrs::new();
    a.set_bool("transpose_b", true);
    let grid = c.op1(&ops::MATMUL, &[base, theta], &a)?;
    let mut out = vec![td[0]];
    out.extend(&extent);
    out.push(spatial);
    Ok(vec![c.reshape(&grid, &out)?])
}

/// `Det` of `[..., n, n]` for n up to 3, by cofactor expansion (larger
/// matrices are unsupported).
fn det(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let d = dims(&x);
    let r = d.len();
    if r < 2 || d[r - 1] != d[r - 2] {
        return Err(OnnxError::invalid(format!("Det of {d:?}: not square")));
    }
    let n = d[r - 1];
    if !(1..=3).contains(&n) {
        return Err(OnnxError::unsupported(format!(
            "Det of {n}×{n} matrices (up to 3×3 are supported)"
        )));
    }
    let batch = d[..r - 2].to_vec();
    let e = |i: usize, j: usize| -> Result<TensorHandle> {
        let row = slice_axis(c, &x, r - 2, i, i + 1)?;
        let v = slice_axis(c, &row, r - 1, j, j + 1)?;
        c.reshape(&v, &batch)
    };
    let mul = |a: &TensorHandle, b: &TensorHandle| c.binary(&ops::MUL, a, b);
    let minor = |r0: usize, r1: usize, c0: usize, c1: usize| -> Result<TensorHandle> {
        let p = mul(&e(r0, c0)?, &e(r1, c1)?)?;
        let q = mul(&e(r0, c1)?, &e(r1, c0)?)?;
        c.binary(&ops::SUB, &p, &q)
    };
    let y = match n {
        1 => e(0, 0)?,
        2 => minor(0, 1, 0, 1)?,
        _ => {
            let a = mul(&e(0, 0)?, &minor(1, 2, 1, 2)?)?;
            let b = mul(&e(0, 1)?, &minor(1, 2, 0, 2)?)?;
            let cc = mul(&e(0, 2)?, &minor(1, 2, 0, 1)?)?;
            let ab = c.binary(&ops::SUB, &a, &b)?;
            c.binary(&ops::ADD, &ab, &cc)?
        }
    };
    Ok(vec![y])
}

/// `MaxUnpool(X, I, output_shape?)`: a zero tensor of the shape the
/// pooling's size rule inverts to, with each value of `X` added at its
/// flat index from `I` (as `MaxPool`'s indices output gives them), then
/// padded at the end of each spatial axis to a larger `output_shape`, as
/// the reference does.
fn max_unpool(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let idx = c.cast(&c.input(1)?, stagecraft_tensor::DType::I64)?;
    let xd = dims(&x);
    if xd.len() < 3 || dims(&idx) != xd {
        return Err(OnnxError::invalid(format!(
            "MaxUnpool values {xd:?} and indices {:?} differ or have no spatial axes",
            dims(&idx)
        )));
    }
    let spatial = xd.len() - 2;
    let kernel = c
        .attr_ints("kernel_shape")
        .ok_or_else(|| OnnxError::invalid("MaxUnpool needs kernel_shape"))?;
    let strides = c.attr_ints("strides").unwrap_or(vec![1; spatial]);
    let pads = c.attr_ints("pads").unwrap_or(vec![0; 2 * spatial]);
    if kernel.len() != spatial || strides.len() != spatial || pads.len() != 2 * spatial {
        return Err(OnnxError::invalid(
            "kernel_shape, strides and pads do not match the spatial axes",
        ));
    }
    let mut natural = vec![xd[0], xd[1]];
    for i in 0..spatial {
        let n = (xd[2 + i] as i64 - 1) * strides[i] + kernel[i] - pads[i] - pads[spatial + i];
        natural.push(n.max(0) as usize);
    }
    let out: Vec<usize> = match c.known_ints(2)? {
        Some(v) => v.iter().map(|&d| d.max(0) as usize).collect(),
        None => natural.clone(),
    };
    if out.len() != xd.len() || out[..2] != xd[..2] || out.iter().zip(&natural).any(|(o, n)| o < n)
    {
        return Err(OnnxError::invalid(format!(
            "output_shape {out:?} does not fit the input {xd:?}"
        )));
    }
    let numel: usize = natural.iter().product();
    let count: usize = xd.iter().product();
    let zeros = c.constant(DenseHostTensor::zeros(
        stagecraft_tensor::TensorMetadata::new(x.dtype(), vec![numel]),
    )?);
    let xf = c.reshape(&x, &[count])?;
    let idf = c.reshape(&idx, &[count])?;
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", 0);
    let y = c.op1(&ops::SCATTER_ADD, &[zeros, idf, xf], &attrs)?;
    let y = c.reshape(&y, &natural)?;
    if out == natural {
        return Ok(vec![y]);
    }
    let before = vec![0i64; out.len()];
    let after: Vec<i64> = out
        .iter()
        .zip(&natural)
        .map(|(o, n)| (o - n) as i64)
        .collect();
    Ok(vec![super::shape::pad_with(c, &y, &before, &after, 0.0)?])
}

/// `RoiAlign(X [N, C, H, W], rois [R, 4], batch_indices [R])`: per region
/// and output bin, `sampling_ratio²` (or adaptive) bilinear samples,
/// averaged (`avg`) or reduced by the maximum of their weighted corner
/// values (`max`, as the reference computes it). The samples' weights are
/// known matrices `[R, H·W, bins]` applied to the gathered images.
fn roi_align(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let xd = dims(&x);
    if xd.len() != 4 {
        return Err(OnnxError::unsupported("RoiAlign on a non-4-D input"));
    }
    let (n, ch, h, w) = (xd[0], xd[1], xd[2], xd[3]);
    let rois = known_f64s(c, 1, "rois")?;
    let batch: Vec<usize> = known_f64s(c, 2, "batch_indices")?
        .iter()
        .map(|&b| b as usize)
        .collect();
    let r = batch.len();
    if rois.len() != 4 * r || batch.iter().any(|&b| b >= n) || h == 0 || w == 0 {
        return Err(OnnxError::invalid(format!(
            "{} roi values and batch indices {batch:?} do not fit {r} regions of a batch of {n}",
            rois.len()
        )));
    }
    let ph = c.attr_int("output_height", 1).max(1) as usize;
    let pw = c.attr_int("output_width", 1).max(1) as usize;
    let ratio = c.attr_int("sampling_ratio", 0);
    let scale = c.attr_float("spatial_scale", 1.0) as f64;
    let half_pixel = match c
        .attr_str("coordinate_transformation_mode", "half_pixel")
        .as_str()
    {
        "half_pixel" => true,
        "output_half_pixel" => false,
        other => {
            return Err(OnnxError::invalid(format!(
                "coordinate_transformation_mode '{other}'"
            )))
        }
    };
    let max = match c.attr_str("mode", "avg").as_str() {
        "avg" => false,
        "max" => true,
        other => return Err(OnnxError::invalid(format!("mode '{other}'"))),
    };
    let offset = if half_pixel { 0.5 } else { 0.0 };
    let bins = ph * pw;
    // Per region: the grid size, and per sample its four (index, weight)
    // corners, or none when the sample falls outside the image.
    let mut grids = Vec::with_capacity(r);
    let mut samples: Vec<Vec<Vec<Corners>>> = Vec::with_capacity(r);
    for ri in 0..r {
        let roi = &rois[4 * ri..4 * ri + 4];
        let (x0, y0) = (roi[0] * scale - offset, roi[1] * scale - offset);
        let (x1, y1) = (roi[2] * scale - offset, roi[3] * scale - offset);
        let (mut rw, mut rh) = (x1 - x0, y1 - y0);
        if !half_pixel {
            rw = rw.max(1.0);
            rh = rh.max(1.0);
        }
        let (bh, bw) = (rh / ph as f64, rw / pw as f64);
        let gh = if ratio > 0 {
            ratio as usize
        } else {
            (rh / ph as f64).ceil() as usize
        };
        let gw = if ratio > 0 {
            ratio as usize
        } else {
            (rw / pw as f64).ceil() as usize
        };
        grids.push((gh * gw).max(1));
        let mut per_bin = Vec::with_capacity(bins);
        for py in 0..ph {
            for px in 0..pw {
                let mut pts = Vec::with_capacity(gh * gw);
                for iy in 0..gh {
                    for ix in 0..gw {
                        let yy = y0 + py as f64 * bh + (iy as f64 + 0.5) * bh / gh as f64;
                        let xx = x0 + px as f64 * bw + (ix as f64 + 0.5) * bw / gw as f64;
                        pts.push(bilinear(yy, xx, h, w));
                    }
                }
                per_bin.push(pts);
            }
        }
        samples.push(per_bin);
    }
    let plane = h * w;
    // The images of the regions, [R, C, H·W].
    let flat = c.reshape(&x, &[n, ch, plane])?;
    let picked = {
        let idx: Vec<i64> = batch.iter().map(|&b| b as i64).collect();
        let idx = c.ints_constant(&idx)?;
        let mut a = OpAttrs::new();
        a.set_int("axis", 0);
        c.op1(&ops::GATHER, &[flat, idx], &a)?
    };
    let apply = |m: Vec<f64>| -> Result<TensorHandle> {
        let m = c.constant(DenseHostTensor::from_slice(&m, [r, plane, bins])?);
        let m = c.cast(&m, x.dtype())?;
        c.binary(&ops::MATMUL, &picked, &m)
    };
    let y = if !max {
        let mut m = vec![0.0; r * plane * bins];
        for ri in 0..r {
            for (bin, pts) in samples[ri].iter().enumerate() {
                for corners in pts {
                    for &(at, wt) in corners {
                        m[(ri * plane + at) * bins + bin] += wt / grids[ri] as f64;
                    }
                }
            }
        }
        apply(m)?
    } else {
        let most = samples
            .iter()
            .flat_map(|b| b.iter().map(|p| p.len()))
            .max()
            .unwrap_or(0);
        let mut acc: Option<TensorHandle> = None;
        for s in 0..most {
            for corner in 0..4 {
                let mut m = vec![0.0; r * plane * bins];
                for ri in 0..r {
                    for (bin, pts) in samples[ri].iter().enumerate() {
                        if let Some(corners) = pts.get(s) {
                            let (at, wt) = corners[corner];
                            m[(ri * plane + at) * bins + bin] += wt;
                        }
                    }
                }
                let term = apply(m)?;
                acc = Some(match acc {
                    Some(a) => c.binary(&ops::MAXIMUM, &a, &term)?,
                    None => term,
                });
            }
        }
        acc.ok_or_else(|| OnnxError::invalid("RoiAlign without samples"))?
    };
    Ok(vec![c.reshape(&y, &[r, ch, ph, pw])?])
}

/// The four (flat index, weight) corners of one bilinear sample.
type Corners = [(usize, f64); 4];

/// The four corners (flat index, weight) of a bilinear sample at `(y, x)`
/// of an `h × w` image; all weights 0 outside `[-1, h] × [-1, w]`.
fn bilinear(y: f64, x: f64, h: usize, w: usize) -> Corners {
    if y < -1.0 || y > h as f64 || x < -1.0 || x > w as f64 {
        return [(0, 0.0); 4];
    }
    let edge = |v: f64, n: usize| -> (usize, usize, f64) {
        let v = v.max(0.0);
        let low = v.floor() as usize;
        if low >= n - 1 {
            (n - 1, n - 1, 0.0)
        } else {
            (low, low + 1, v - low as f64)
        }
    };
    let (y0, y1, ly) = edge(y, h);
    let (x0, x1, lx) = edge(x, w);
    let (hy, hx) = (1.0 - ly, 1.0 - lx);
    [
        (y0 * w + x0, hy * hx),
        (y0 * w + x1, hy * lx),
        (y1 * w + x0, ly * hx),
        (y1 * w + x1, ly * lx),
    ]
}

/// `DeformConv` (2-D): for each kernel tap, every output position samples
/// the input bilinearly at its regular tap position moved by the offset
/// input (per offset group; corners outside the image read 0), scaled by
/// the optional mask; the samples of all taps are multiplied with the
/// weights per group, plus the bias.
fn deform_conv(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let (w, offset) = (c.input(1)?, c.input(2)?);
    let (xd, wd, od) = (dims(&x), dims(&w), dims(&offset));
    if xd.len() != 4 || wd.len() != 4 || od.len() != 4 {
        return Err(OnnxError::unsupported(
            "DeformConv on non-4-D inputs (only 2-D convolutions are supported)",
        ));
    }
    let (n, ch, h, wi) = (xd[0], xd[1], xd[2], xd[3]);
    let (oc, kh, kw) = (wd[0], wd[2], wd[3]);
    let group = c.attr_int("group", 1).max(1) as usize;
    let og = c.attr_int("offset_group", 1).max(1) as usize;
    let ints = |name: &str, default: i64, len: usize| -> Vec<usize> {
        c.attr_ints(name)
            .filter(|v| v.len() == len)
            .unwrap_or(vec![default; len])
            .iter()
            .map(|&v| v.max(0) as usize)
            .collect()
    };
    let strides = ints("strides", 1, 2);
    let dil = ints("dilations", 1, 2);
    let pads = ints("pads", 0, 4);
    let k = kh * kw;
    if !ch.is_multiple_of(group)
        || !oc.is_multiple_of(group)
        || !ch.is_multiple_of(og)
        || wd[1] * group != ch
        || strides.contains(&0)
        || dil.contains(&0)
    {
        return Err(OnnxError::invalid(format!(
            "DeformConv input {xd:?}, weight {wd:?}, group {group}, offset_group {og}"
        )));
    }
    let span = |size: usize, pb: usize, pe: usize, kk: usize, d: usize, s: usize| {
        (size + pb + pe)
            .checked_sub(d * (kk - 1) + 1)
            .map(|v| v / s + 1)
    };
    let (oh, ow) = match (
        span(h, pads[0], pads[2], kh, dil[0], strides[0]),
        span(wi, pads[1], pads[3], kw, dil[1], strides[1]),
    ) {
        (Some(a), Some(b)) => (a, b),
        _ => {
            return Err(OnnxError::invalid(
                "DeformConv kernel larger than the padded input",
            ))
        }
    };
    let p = oh * ow;
    if od != [n, og * 2 * k, oh, ow] {
        return Err(OnnxError::invalid(format!(
            "offset {od:?} is not [{n}, {}, {oh}, {ow}]",
            og * 2 * k
        )));
    }
    let mask = c.opt_input(4).cloned();
    if let Some(m) = &mask {
        if dims(m) != [n, og * k, oh, ow] {
            return Err(OnnxError::invalid(format!(
                "mask {:?} is not [{n}, {}, {oh}, {ow}]",
                dims(m),
                og * k
            )));
        }
    }
    let dt = x.dtype();
    let cg = ch / og;
    let flat = c.reshape(&x, &[n, ch, h * wi])?;
    let channel = |t: &TensorHandle, i: usize| -> Result<TensorHandle> {
        let s = slice_axis(c, t, 1, i, i + 1)?;
        c.reshape(&s, &[n, 1, p])
    };
    let mut taps = Vec::with_capacity(k);
    for tap in 0..k {
        let (ti, tj) = (tap / kw, tap % kw);
        // The regular tap positions of every output position.
        let grid = |s: usize, pad: usize, t: usize, d: usize, inner: bool| {
            (0..p)
                .map(|q| {
                    let at = if inner { q % ow } else { q / ow };
                    (at * s) as f64 - pad as f64 + (t * d) as f64
                })
                .collect::<Vec<f64>>()
        };
        let base_h = grid(strides[0], pads[0], ti, dil[0], false);
        let base_w = grid(strides[1], pads[1], tj, dil[1], true);
        let base_h = c.cast(
            &c.constant(DenseHostTensor::from_slice(&base_h, [1, 1, p])?),
            dt,
        )?;
        let base_w = c.cast(
            &c.constant(DenseHostTensor::from_slice(&base_w, [1, 1, p])?),
            dt,
        )?;
        let mut groups = Vec::with_capacity(og);
        for g in 0..og {
            let dy = channel(&offset, g * 2 * k + 2 * tap)?;
            let dx = channel(&offset, g * 2 * k + 2 * tap + 1)?;
            let y = c.binary(&ops::ADD, &base_h, &dy)?;
            let xx = c.binary(&ops::ADD, &base_w, &dx)?;
            let y0 = c.unary(&ops::FLOOR, &y)?;
            let x0 = c.unary(&ops::FLOOR, &xx)?;
            let ly = c.binary(&ops::SUB, &y, &y0)?;
            let lx = c.binary(&ops::SUB, &xx, &x0)?;
            let hy = c.binary(&ops::SUB, &c.scalar(1.0, dt)?, &ly)?;
            let hx = c.binary(&ops::SUB, &c.scalar(1.0, dt)?, &lx)?;
            let image = slice_axis(c, &flat, 1, g * cg, (g + 1) * cg)?;
            let mut b = OpAttrs::new();
            b.set_dims("shape", &[n, cg, p]);
            let mut sum: Option<TensorHandle> = None;
            for (dyi, dxi) in [(0.0, 0.0), (0.0, 1.0), (1.0, 0.0), (1.0, 1.0)] {
                let yc = c.with_scalar(&ops::ADD, &y0, dyi)?;
                let xc = c.with_scalar(&ops::ADD, &x0, dxi)?;
                let inside = |v: &TensorHandle, size: usize| -> Result<TensorHandle> {
                    let ge = c.binary(&ops::GREATER_EQUAL, v, &c.scalar(0.0, dt)?)?;
                    let le = c.binary(&ops::LESS_EQUAL, v, &c.scalar(size as f64 - 1.0, dt)?)?;
                    c.binary(&ops::LOGICAL_AND, &ge, &le)
                };
                let ok = c.binary(&ops::LOGICAL_AND, &inside(&yc, h)?, &inside(&xc, wi)?)?;
                let yk = c.with_scalar(
                    &ops::MINIMUM,
                    &c.with_scalar(&ops::MAXIMUM, &yc, 0.0)?,
                    h as f64 - 1.0,
                )?;
                let xk = c.with_scalar(
                    &ops::MINIMUM,
                    &c.with_scalar(&ops::MAXIMUM, &xc, 0.0)?,
                    wi as f64 - 1.0,
                )?;
                let lin = c.binary(&ops::ADD, &c.with_scalar(&ops::MUL, &yk, wi as f64)?, &xk)?;
                let lin = c.cast(&lin, stagecraft_tensor::DType::I64)?;
                let lin = c.op1(&ops::BROADCAST_TO, &[lin], &b)?;
                let mut ga = OpAttrs::new();
                ga.set_int("axis", 2);
                let v = c.op1(&ops::GATHER_ELEMENTS, &[image.clone(), lin], &ga)?;
                let wy = if dyi == 0.0 { &hy } else { &ly };
                let wx = if dxi == 0.0 { &hx } else { &lx };
                let wt = c.binary(&ops::MUL, wy, wx)?;
                let zero = c.scalar(0.0, dt)?;
                let wt = c.op1(&ops::SELECT, &[ok, wt, zero], &OpAttrs::new())?;
                let term = c.binary(&ops::MUL, &v, &wt)?;
                sum = Some(match sum {
                    Some(a) => c.binary(&ops::ADD, &a, &term)?,
                    None => term,
                });
            }
            let mut v = sum.ok_or_else(|| OnnxError::invalid("DeformConv without corners"))?;
            if let Some(m) = &mask {
                v = c.binary(&ops::MUL, &v, &channel(m, g * k + tap)?)?;
            }
            groups.push(v);
        }
        let all = if groups.len() == 1 {
            groups.remove(0)
        } else {
            let mut a = OpAttrs::new();
            a.set_int("axis", 1);
            c.op1(&ops::CONCAT, &groups, &a)?
        };
        taps.push(c.reshape(&all, &[n, ch, 1, p])?);
    }
    // [N, C, K, P] as columns [N, C·K, P], channel-major like the weights.
    let cols = if taps.len() == 1 {
        taps.remove(0)
    } else {
        let mut a = OpAttrs::new();
        a.set_int("axis", 2);
        c.op1(&ops::CONCAT, &taps, &a)?
    };
    let cols = c.reshape(&cols, &[n, ch * k, p])?;
    let (cpg, opg) = (ch / group, oc / group);
    let mut outs = Vec::with_capacity(group);
    for gi in 0..group {
        let wg = slice_axis(c, &w, 0, gi * opg, (gi + 1) * opg)?;
        let wg = c.reshape(&wg, &[opg, cpg * k])?;
        let colg = slice_axis(c, &cols, 1, gi * cpg * k, (gi + 1) * cpg * k)?;
        outs.push(c.binary(&ops::MATMUL, &wg, &colg)?);
    }
    let y = if outs.len() == 1 {
        outs.remove(0)
    } else {
        let mut a = OpAttrs::new();
        a.set_int("axis", 1);
        c.op1(&ops::CONCAT, &outs, &a)?
    };
    let mut y = c.reshape(&y, &[n, oc, oh, ow])?;
    if let Some(bias) = c.opt_input(3) {
        let bias = c.reshape(bias, &[1, oc, 1, 1])?;
        y = c.binary(&ops::ADD, &y, &bias)?;
    }
    Ok(vec![y])
}
