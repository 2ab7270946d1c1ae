//! Shape and indexing ONNX ops: `Reshape`, `Flatten`, `Transpose`,
//! `Squeeze`/`Unsqueeze`, `Concat`, `Split`, `Slice`, `Gather`, `Shape`,
//! `Size`, `Constant`, `ConstantOfShape`, `Expand`, `Tile`, `Range`, `Pad`,
//! `Trilu`, `CumSum`, `TopK`, `Dropout` (inference).

use super::{axis, dims, ints_of, Ctx, Translate};
use crate::error::{OnnxError, Result};
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::{
    broadcast_shapes, DType, DenseHostTensor, HostTensor, Scalar, Shape, TensorMetadata,
};

pub(super) fn lookup(op_type: &str) -> Option<Translate> {
    Some(match op_type {
        "Reshape" => reshape,
        "Flatten" => flatten,
        "Transpose" => transpose,
        "Squeeze" => squeeze,
        "Unsqueeze" => unsqueeze,
        "Concat" => concat,
        "Split" => split,
        "Slice" => slice,
        "Gather" => gather,
        "GatherElements" => gather_elements,
        "GatherND" => gather_nd,
        "Shape" => shape,
        "Size" => size,
        "Constant" => constant,
        "ConstantOfShape" => constant_of_shape,
        "Expand" => expand,
        "Tile" => tile,
        "Range" => range,
        "Pad" => pad,
        "Trilu" => trilu,
        "CumSum" => cumsum,
        "CumProd" => cumprod,
        "TopK" => top_k,
        "Dropout" => dropout,
        "OneHot" => one_hot,
        "DepthToSpace" => depth_to_space,
        "SpaceToDepth" => space_to_depth,
        "EyeLike" => eye_like,
        "ScatterElements" | "Scatter" => scatter_elements,
        "ScatterND" => scatter_nd,
        "CenterCropPad" => center_crop_pad,
        "Col2Im" => col2im,
        _ => return None,
    })
}

fn to_dims(v: &[i64], what: &str) -> Result<Vec<usize>> {
    v.iter()
        .map(|&d| {
            usize::try_from(d).map_err(|_| OnnxError::invalid(format!("negative {what} {d}")))
        })
        .collect()
}

/// ONNX `Reshape`'s target: `0` copies the input's dimension (unless
/// `allowzero`), `-1` is inferred.
pub(crate) fn reshape_target(
    input: &[usize],
    target: &[i64],
    allowzero: bool,
) -> Result<Vec<usize>> {
    let mut out = Vec::with_capacity(target.len());
    let mut infer = None;
    for (i, &d) in target.iter().enumerate() {
        match d {
            -1 if infer.is_none() => {
                infer = Some(i);
                out.push(1);
            }
            0 if !allowzero => out.push(*input.get(i).ok_or_else(|| {
                OnnxError::invalid(format!(
                    "shape {target:?}: 0 at {i} copies no input dimension"
                ))
            })?),
            d if d >= 0 => out.push(d as usize),
            _ => return Err(OnnxError::invalid(format!("invalid shape {target:?}"))),
        }
    }
    let total: usize = input.iter().product();
    if let Some(i) = infer {
        let known: usize = out.iter().product();
        if known == 0 || !total.is_multiple_of(known) {
            return Err(OnnxError::invalid(format!(
                "cannot reshape {input:?} to {target:?}"
            )));
        }
        out[i] = total / known;
    }
    if out.iter().product::<usize>() != total {
        return Err(OnnxError::invalid(format!(
            "cannot reshape {input:?} ({total} elements) to {target:?}"
        )));
    }
    Ok(out)
}

fn reshape(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let target = if c.opset < 5 {
        c.attr_ints("shape").unwrap_or_default()
    } else {
        c.known_ints(1)?
            .ok_or_else(|| OnnxError::invalid("Reshape needs a shape"))?
    };
    let allowzero = c.attr_int("allowzero", 0) != 0;
    let d = reshape_target(&dims(&x), &target, allowzero)?;
    Ok(vec![c.reshape(&x, &d)?])
}

fn flatten(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    let a = c.attr_int("axis", 1);
    let a = if a == d.len() as i64 {
        d.len()
    } else {
        axis(a, d.len())?
    };
    let outer: usize = d[..a].iter().product();
    let inner: usize = d[a..].iter().product();
    Ok(vec![c.reshape(&x, &[outer, inner])?])
}

fn transpose_by(c: &Ctx<'_>, x: &TensorHandle, perm: &[i64]) -> Result<TensorHandle> {
    if perm.iter().enumerate().all(|(i, &p)| p == i as i64) {
        return Ok(x.clone());
    }
    let mut a = OpAttrs::new();
    a.set_ints("perm", perm);
    c.op1(&ops::TRANSPOSE, std::slice::from_ref(x), &a)
}

fn transpose(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let rank = dims(&x).len() as i64;
    let perm = c
        .attr_ints("perm")
        .unwrap_or_else(|| (0..rank).rev().collect());
    Ok(vec![transpose_by(c, &x, &perm)?])
}

/// Axes from the attribute (before `input_since`) or input 1.
fn axes_arg(c: &Ctx<'_>, input_since: i64) -> Result<Option<Vec<i64>>> {
    if c.opset < input_since {
        Ok(c.attr_ints("axes"))
    } else {
        c.known_ints(1)
    }
}

fn squeeze(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    let axes = match axes_arg(c, 13)? {
        Some(a) => a
            .iter()
            .map(|&a| axis(a, d.len()))
            .collect::<Result<Vec<_>>>()?,
        None => (0..d.len()).filter(|&i| d[i] == 1).collect(),
    };
    if let Some(&a) = axes.iter().find(|&&a| d[a] != 1) {
        return Err(OnnxError::invalid(format!(
            "cannot squeeze axis {a} of length {}",
            d[a]
        )));
    }
    let out: Vec<usize> = (0..d.len())
        .filter(|i| !axes.contains(i))
        .map(|i| d[i])
        .collect();
    Ok(vec![c.reshape(&x, &out)?])
}

fn unsqueeze(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    let axes = axes_arg(c, 13)?.ok_or_else(|| OnnxError::invalid("Unsqueeze needs axes"))?;
    let rank = d.len() + axes.len();
    let mut axes = axes
        .iter()
        .map(|&a| axis(a, rank))
        .collect::<Result<Vec<_>>>()?;
    axes.sort_unstable();
    axes.dedup();
    if axes.len() + d.len() != rank {
        return Err(OnnxError::invalid("Unsqueeze axes repeat"));
    }
    let mut rest = d.iter();
    let out: Vec<usize> = (0..rank)
        .map(|i| {
            if axes.contains(&i) {
                1
            } else {
                rest.next().copied().unwrap_or(1)
            }
        })
        .collect();
    Ok(vec![c.reshape(&x, &out)?])
}

fn concat(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let xs = c.inputs();
    let rank = xs.first().map_or(0, |x| dims(x).len());
    let a = axis(c.attr_int("axis", 0), rank)?;
    // Empty inputs add nothing; a lone input is itself.
    let nonempty: Vec<TensorHandle> = xs
        .iter()
        .filter(|x| x.metadata().shape.numel() > 0)
        .cloned()
        .collect();
    if nonempty.len() == 1 && xs.len() > 1 {
        return Ok(vec![nonempty[0].clone()]);
    }
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", a as i64);
    Ok(vec![c.op1(&ops::CONCAT, &xs, &attrs)?])
}

/// Slices axis `a` of `x` from `start` (inclusive) to `end`, step 1.
pub(crate) fn slice_axis(
    c: &Ctx<'_>,
    x: &TensorHandle,
    a: usize,
    start: usize,
    end: usize,
) -> Result<TensorHandle> {
    let d = dims(x);
    let mut starts = vec![0i64; d.len()];
    let mut ends: Vec<i64> = d.iter().map(|&v| v as i64).collect();
    starts[a] = start as i64;
    ends[a] = end as i64;
    if start == 0 && end == d[a] {
        return Ok(x.clone());
    }
    let mut attrs = OpAttrs::new();
    attrs.set_ints("starts", &starts);
    attrs.set_ints("ends", &ends);
    c.op1(&ops::SLICE, std::slice::from_ref(x), &attrs)
}

fn split(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    let a = axis(c.attr_int("axis", 0), d.len())?;
    let n = c.node.output.len();
    let sizes = if c.opset < 13 {
        match c.attr_ints("split") {
            Some(s) => Some(s),
            None => c.known_ints(1)?,
        }
    } else {
        c.known_ints(1)?
    };
    let sizes: Vec<usize> = match sizes {
        Some(s) => to_dims(&s, "split size")?,
        None => {
            let parts = if c.opset >= 18 && c.has_attr("num_outputs") {
                c.attr_int("num_outputs", n as i64) as usize
            } else {
                n
            };
            if parts == 0 {
                return Err(OnnxError::invalid("Split into zero parts"));
            }
            let each = d[a].div_ceil(parts);
            (0..parts)
                .map(|i| each.min(d[a].saturating_sub(i * each)))
                .collect()
        }
    };
    if sizes.iter().sum::<usize>() != d[a] {
        return Err(OnnxError::invalid(format!(
            "split sizes {sizes:?} do not add up to {}",
            d[a]
        )));
    }
    let mut start = 0;
    sizes
        .iter()
        .map(|&s| {
            let r = slice_axis(c, &x, a, start, start + s);
            start += s;
            r
        })
        .collect()
}

fn slice(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    let (starts, ends, axes, steps) = if c.opset < 10 {
        (
            c.attr_ints("starts").unwrap_or_default(),
            c.attr_ints("ends").unwrap_or_default(),
            c.attr_ints("axes"),
            None,
        )
    } else {
        (
            c.known_ints(1)?.unwrap_or_default(),
            c.known_ints(2)?.unwrap_or_default(),
            c.known_ints(3)?,
            c.known_ints(4)?,
        )
    };
    let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
    if ends.len() != starts.len() || axes.len() != starts.len() {
        return Err(OnnxError::invalid("starts, ends and axes differ in length"));
    }
    let mut s_all = vec![0i64; d.len()];
    let mut e_all = vec![i64::MAX; d.len()];
    let mut st_all = vec![1i64; d.len()];
    for (i, &ax) in axes.iter().enumerate() {
        let a = axis(ax, d.len())?;
        let step = steps.as_ref().map_or(1, |s| s.get(i).copied().unwrap_or(1));
        if step == 0 {
            return Err(OnnxError::invalid("slice step 0"));
        }
        s_all[a] = starts[i];
        e_all[a] = ends[i];
        st_all[a] = step;
    }
    let mut y = x;
    if st_all.iter().any(|&s| s < 0) {
        // Negative steps: gather the indices of each such axis.
        for a in 0..d.len() {
            if st_all[a] > 0 {
                continue;
            }
            let n = d[a] as i64;
            let step = st_all[a];
            let clamp = |v: i64, lo: i64, hi: i64| v.clamp(lo, hi);
            let s = if s_all[a] < 0 { s_all[a] + n } else { s_all[a] };
            let e = if e_all[a] < -n {
                -1
            } else if e_all[a] < 0 {
                e_all[a] + n
            } else {
                e_all[a]
            };
            let s = clamp(s, -1, n - 1);
            let e = clamp(e, -1, n - 1);
            let mut idx = Vec::new();
            let mut i = s;
            while i > e {
                idx.push(i);
                i += step;
            }
            let indices = c.ints_constant(&idx)?;
            let mut attrs = OpAttrs::new();
            attrs.set_int("axis", a as i64);
            y = c.op1(&ops::GATHER, &[y, indices], &attrs)?;
            s_all[a] = 0;
            e_all[a] = i64::MAX;
            st_all[a] = 1;
        }
    }
    // Ends past i64 range mean "to the end".
    let e_all: Vec<i64> = e_all
        .iter()
        .map(|&e| if e >= i64::MAX / 2 { i64::MAX } else { e })
        .collect();
    let d = dims(&y);
    let full = (0..d.len()).all(|a| {
        s_all[a] == 0 && st_all[a] == 1 && (e_all[a] == i64::MAX || e_all[a] >= d[a] as i64)
    });
    if full {
        return Ok(vec![y]);
    }
    let mut attrs = OpAttrs::new();
    attrs.set_ints("starts", &s_all);
    attrs.set_ints("ends", &e_all);
    attrs.set_ints("steps", &st_all);
    Ok(vec![c.op1(&ops::SLICE, &[y], &attrs)?])
}

fn gather(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let a = axis(c.attr_int("axis", 0), dims(&x).len())?;
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", a as i64);
    Ok(vec![c.op1(&ops::GATHER, &[x, c.input(1)?], &attrs)?])
}

fn gather_elements(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let a = axis(c.attr_int("axis", 0), dims(&x).len())?;
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", a as i64);
    Ok(vec![c.op1(
        &ops::GATHER_ELEMENTS,
        &[x, c.input(1)?],
        &attrs,
    )?])
}

fn shape(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let d: Vec<i64> = dims(&c.input(0)?).iter().map(|&v| v as i64).collect();
    let r = d.len() as i64;
    let clamp = |v: i64| if v < 0 { (v + r).max(0) } else { v.min(r) } as usize;
    let start = clamp(c.attr_int("start", 0));
    let end = clamp(c.attr_int("end", r));
    let part = if start < end { &d[start..end] } else { &[][..] };
    Ok(vec![c.ints_constant(part)?])
}

fn size(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let n = c.input(0)?.metadata().shape.numel() as i64;
    Ok(vec![c.constant(DenseHostTensor::from_slice(
        &[n],
        Shape::scalar(),
    )?)])
}

fn constant(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    if let Some(t) = c.attr_tensor("value")? {
        return Ok(vec![c.constant(t)]);
    }
    let attr = c
        .node
        .attribute
        .first()
        .ok_or_else(|| OnnxError::invalid("Constant without a value"))?;
    let t = match attr.name() {
        "value_float" => DenseHostTensor::from_slice(&[attr.f()], Shape::scalar())?,
        "value_floats" => DenseHostTensor::from_slice(&attr.floats, [attr.floats.len()])?,
        "value_int" => DenseHostTensor::from_slice(&[attr.i()], Shape::scalar())?,
        "value_ints" => DenseHostTensor::from_slice(&attr.ints, [attr.ints.len()])?,
        other => return Err(OnnxError::unsupported(format!("Constant {other}"))),
    };
    Ok(vec![c.constant(t)])
}

fn constant_of_shape(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let shape = to_dims(&c.known_ints(0)?.unwrap_or_default(), "dimension")?;
    let value = match c.attr_tensor("value")? {
        Some(t) => t
            .get_scalar(0)
            .ok_or_else(|| OnnxError::invalid("ConstantOfShape value is empty"))?,
        None => Scalar::F32(0.0),
    };
    let meta = TensorMetadata::new(value.dtype(), Shape::new(&shape));
    Ok(vec![
        c.constant(HostTensor::filled(value, &meta).to_dense()?)
    ])
}

fn expand(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let target = to_dims(&c.known_ints(1)?.unwrap_or_default(), "dimension")?;
    let out = broadcast_shapes(&x.metadata().shape, &Shape::new(&target))
        .map_err(|e| OnnxError::invalid(e.message().to_string()))?;
    if out == x.metadata().shape {
        return Ok(vec![x]);
    }
    let mut attrs = OpAttrs::new();
    attrs.set_dims("shape", out.dims());
    Ok(vec![c.op1(&ops::BROADCAST_TO, &[x], &attrs)?])
}

fn tile(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    let reps = to_dims(&c.known_ints(1)?.unwrap_or_default(), "repeat")?;
    if reps.len() != d.len() {
        return Err(OnnxError::invalid(format!(
            "{} repeats for rank {}",
            reps.len(),
            d.len()
        )));
    }
    // [d0, d1] -> [1, d0, 1, d1] -> [r0, d0, r1, d1] -> [r0*d0, r1*d1]
    let mut spread = Vec::new();
    let mut wide = Vec::new();
    for (&n, &r) in d.iter().zip(&reps) {
        spread.extend([1, n]);
        wide.extend([r, n]);
    }
    let y = c.reshape(&x, &spread)?;
    let mut attrs = OpAttrs::new();
    attrs.set_dims("shape", &wide);
    let y = c.op1(&ops::BROADCAST_TO, &[y], &attrs)?;
    let out: Vec<usize> = d.iter().zip(&reps).map(|(n, r)| n * r).collect();
    Ok(vec![c.reshape(&y, &out)?])
}

fn range(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let dtype = c.input(0)?.dtype();
    let start = c.known(0);
    let (Some(start), Some(limit), Some(delta)) = (start, c.known(1), c.known(2)) else {
        return Err(OnnxError::unsupported(
            "Range whose bounds are computed while the model runs",
        ));
    };
    let t = if dtype.is_float() {
        let (s, l, d) = (
            super::scalar_f64(start.get_scalar(0).unwrap_or(Scalar::F64(0.0))),
            super::scalar_f64(limit.get_scalar(0).unwrap_or(Scalar::F64(0.0))),
            super::scalar_f64(delta.get_scalar(0).unwrap_or(Scalar::F64(1.0))),
        );
        let n = ((l - s) / d).ceil().max(0.0) as usize;
        let v: Vec<f64> = (0..n).map(|i| s + i as f64 * d).collect();
        let t = DenseHostTensor::from_slice(&v, [n])?;
        cast_host(c, t, dtype)?
    } else {
        let (s, l, d) = (ints_of(start)?[0], ints_of(limit)?[0], ints_of(delta)?[0]);
        if d == 0 {
            return Err(OnnxError::invalid("Range delta 0"));
        }
        let n = ((l - s) as f64 / d as f64).ceil().max(0.0) as usize;
        let v: Vec<i64> = (0..n as i64).map(|i| s + i * d).collect();
        cast_host(c, DenseHostTensor::from_slice(&v, [n])?, dtype)?
    };
    Ok(vec![c.constant(t)])
}

/// Casts a host tensor on the CPU.
fn cast_host(c: &Ctx<'_>, t: DenseHostTensor, dtype: DType) -> Result<DenseHostTensor> {
    if t.dtype() == dtype {
        return Ok(t);
    }
    let cpu = stagecraft_runtime::Device::cpu();
    let h = stagecraft_runtime::TensorHandle::available(cpu, t.into());
    let mut a = OpAttrs::new();
    a.set_dtype("dtype", dtype);
    let _ = c;
    let r = stagecraft_runtime::execute(
        &ops::CAST,
        cpu,
        stagecraft_tensor::Location::caller(),
        std::iter::once(h).collect(),
        (&a).into(),
    );
    Ok(r[0].wait()?.to_dense()?)
}

fn pad(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    let mode = c.attr_str("mode", "constant");
    if !matches!(mode.as_str(), "constant" | "reflect" | "edge" | "wrap") {
        return Err(OnnxError::unsupported(format!("Pad mode {mode}")));
    }
    let (pads, value) = if c.opset < 11 {
        (
            c.attr_ints("pads")
                .or_else(|| c.attr_ints("paddings"))
                .unwrap_or_default(),
            c.attr_float("value", 0.0) as f64,
        )
    } else {
        (
            c.known_ints(1)?.unwrap_or_default(),
            c.known_f64(2)?.unwrap_or(0.0),
        )
    };
    let axes: Vec<usize> = match c.known_ints(3)? {
        Some(a) => a.iter().map(|&a| axis(a, d.len())).collect::<Result<_>>()?,
        None => (0..d.len()).collect(),
    };
    if pads.len() != 2 * axes.len() {
        return Err(OnnxError::invalid(format!(
            "{} pads for {} axes",
            pads.len(),
            axes.len()
        )));
    }
    let mut before = vec![0i64; d.len()];
    let mut after = vec![0i64; d.len()];
    for (i, &a) in axes.iter().enumerate() {
        before[a] = pads[i];
        after[a] = pads[i + axes.len()];
    }
    if mode == "constant" {
        return Ok(vec![pad_with(c, &x, &before, &after, value)?]);
    }
    // reflect, edge, wrap: each padded axis gathers from computed source
    // indices (a negative pad crops).
    let mut y = x;
    for a in 0..d.len() {
        if before[a] == 0 && after[a] == 0 {
            continue;
        }
        let n = d[a] as i64;
        let len = n + before[a] + after[a];
        if n == 0 || len < 0 {
            return Err(OnnxError::invalid(format!(
                "Pad {mode} of an axis of length {n} by {} and {}",
                before[a], after[a]
            )));
        }
        let idx: Vec<i64> = (0..len)
            .map(|j| {
                let k = j - before[a];
                match mode.as_str() {
                    "edge" => k.clamp(0, n - 1),
                    "wrap" => k.rem_euclid(n),
                    _ if n == 1 => 0,
                    _ => {
                        let m = k.rem_euclid(2 * (n - 1));
                        if m >= n {
                            2 * (n - 1) - m
                        } else {
                            m
                        }
                    }
                }
            })
            .collect();
        let idx = c.ints_constant(&idx)?;
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", a as i64);
        y = c.op1(&ops::GATHER, &[y, idx], &attrs)?;
    }
    Ok(vec![y])
}

/// Pads (positive) or crops (negative) each axis of `x`.
pub(crate) fn pad_with(
    c: &Ctx<'_>,
    x: &TensorHandle,
    before: &[i64],
    after: &[i64],
    value: f64,
) -> Result<TensorHandle> {
    let mut y = x.clone();
    if before.iter().chain(after).any(|&p| p < 0) {
        let d = dims(&y);
        let starts: Vec<i64> = before.iter().map(|&p| (-p).max(0)).collect();
        let ends: Vec<i64> = after
            .iter()
            .zip(&d)
            .map(|(&p, &n)| n as i64 - (-p).max(0))
            .collect();
        let mut attrs = OpAttrs::new();
        attrs.set_ints("starts", &starts);
        attrs.set_ints("ends", &ends);
        y = c.op1(&ops::SLICE, &[y], &attrs)?;
    }
    if before.iter().chain(after).all(|&p| p <= 0) {
        return Ok(y);
    }
    let pads: Vec<i64> = before
        .iter()
        .zip(after)
        .flat_map(|(&b, &a)| [b.max(0), a.max(0)])
        .collect();
    let mut attrs = OpAttrs::new();
    attrs.set_ints("pads", &pads);
    attrs.set_float("value", value);
    c.op1(&ops::PAD, &[y], &attrs)
}

fn trilu(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let k = c
        .known_ints(1)?
        .map_or(0, |v| v.first().copied().unwrap_or(0));
    let mut attrs = OpAttrs::new();
    attrs.set_bool("upper", c.attr_int("upper", 1) != 0);
    attrs.set_int("k", k);
    Ok(vec![c.op1(&ops::TRILU, &[c.input(0)?], &attrs)?])
}

fn cumsum(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let a = c
        .known_ints(1)?
        .and_then(|v| v.first().copied())
        .ok_or_else(|| OnnxError::invalid("CumSum needs an axis"))?;
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", axis(a, dims(&x).len())? as i64);
    attrs.set_bool("exclusive", c.attr_int("exclusive", 0) != 0);
    attrs.set_bool("reverse", c.attr_int("reverse", 0) != 0);
    Ok(vec![c.op1(&ops::CUMSUM, &[x], &attrs)?])
}

fn top_k(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let k = if c.opset < 10 {
        c.attr_int("k", 1)
    } else {
        c.known_ints(1)?
            .and_then(|v| v.first().copied())
            .ok_or_else(|| OnnxError::invalid("TopK needs k"))?
    };
    let mut attrs = OpAttrs::new();
    attrs.set_int("k", k);
    attrs.set_int("axis", axis(c.attr_int("axis", -1), dims(&x).len())? as i64);
    attrs.set_bool("largest", c.attr_int("largest", 1) != 0);
    attrs.set_bool("sorted", c.attr_int("sorted", 1) != 0);
    c.op(&ops::TOP_K, &[x], &attrs)
}

fn dropout(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let training = c.opset >= 12 && c.known_ints(2)?.is_some_and(|v| v.first() == Some(&1));
    // Training with a ratio of 0 drops nothing: the identity, every mask
    // entry kept. Any other ratio draws a random mask no reference shares.
    let drops_nothing = training && c.known_f64(1)? == Some(0.0);
    if (training && !drops_nothing) || c.attr_int("is_test", 1) == 0 && c.opset < 7 {
        return Err(OnnxError::unsupported("Dropout in training mode"));
    }
    let mask_meta = TensorMetadata::new(DType::Bool, x.metadata().shape.clone());
    let mask = c.constant(HostTensor::filled(Scalar::Bool(true), &mask_meta).to_dense()?);
    Ok(vec![x, mask])
}

fn one_hot(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let indices = c.input(0)?;
    let depth = c
        .known_f64(1)?
        .ok_or_else(|| OnnxError::invalid("OneHot needs a depth"))?;
    let depth = depth as i64;
    if depth < 1 {
        return Err(OnnxError::invalid(format!("OneHot depth {depth}")));
    }
    let values = c.input(2)?;
    let rank = dims(&indices).len() + 1;
    let a = axis(c.attr_int("axis", -1), rank)?;
    // Negative indices count from the end.
    let idx = c.cast(&indices, DType::I64)?;
    let zero = c.scalar(0.0, DType::I64)?;
    let neg = c.binary(&ops::LESS, &idx, &zero)?;
    let wrapped = c.with_scalar(&ops::ADD, &idx, depth as f64)?;
    let idx = c.op1(&ops::SELECT, &[neg, wrapped, idx], &OpAttrs::new())?;
    let mut d = dims(&idx);
    d.insert(a, 1);
    let idx = c.reshape(&idx, &d)?;
    let iota = super::reduce::iota_along(c, depth as usize, a, rank)?;
    let hit = c.binary(&ops::EQUAL, &iota, &idx)?;
    let off = super::shape::slice_axis(c, &c.reshape(&values, &[2])?, 0, 0, 1)?;
    let on = super::shape::slice_axis(c, &c.reshape(&values, &[2])?, 0, 1, 2)?;
    let off = c.reshape(&off, &[])?;
    let on = c.reshape(&on, &[])?;
    Ok(vec![c.op1(
        &ops::SELECT,
        &[hit, on, off],
        &OpAttrs::new(),
    )?])
}

fn depth_to_space(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    if d.len() != 4 {
        return Err(OnnxError::invalid("DepthToSpace needs [N, C, H, W]"));
    }
    let b = c.attr_int("blocksize", 1).max(1) as usize;
    let (n, ch, h, w) = (d[0], d[1], d[2], d[3]);
    if ch % (b * b) != 0 {
        return Err(OnnxError::invalid(format!(
            "{ch} channels are not divisible by blocksize² = {}",
            b * b
        )));
    }
    let cc = ch / (b * b);
    let (split, perm): (Vec<usize>, [i64; 6]) = if c.attr_str("mode", "DCR") == "CRD" {
        (vec![n, cc, b, b, h, w], [0, 1, 4, 2, 5, 3])
    } else {
        (vec![n, b, b, cc, h, w], [0, 3, 4, 1, 5, 2])
    };
    let y = c.reshape(&x, &split)?;
    let y = transpose_by(c, &y, &perm)?;
    Ok(vec![c.reshape(&y, &[n, cc, h * b, w * b])?])
}

fn space_to_depth(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    if d.len() != 4 {
        return Err(OnnxError::invalid("SpaceToDepth needs [N, C, H, W]"));
    }
    let b = c.attr_int("blocksize", 1).max(1) as usize;
    let (n, ch, h, w) = (d[0], d[1], d[2], d[3]);
    if h % b != 0 || w % b != 0 {
        return Err(OnnxError::invalid(
            "SpaceToDepth: H and W must divide by blocksize",
        ));
    }
    let y = c.reshape(&x, &[n, ch, h / b, b, w / b, b])?;
    let y = transpose_by(c, &y, &[0, 3, 5, 1, 2, 4])?;
    Ok(vec![c.reshape(&y, &[n, ch * b * b, h / b, w / b])?])
}

fn eye_like(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    if d.len() != 2 {
        return Err(OnnxError::invalid("EyeLike needs a matrix"));
    }
    let dtype = if c.has_attr("dtype") {
        crate::tensor::dtype_of(c.attr_int("dtype", 1) as i32)?
    } else {
        x.dtype()
    };
    let k = c.attr_int("k", 0);
    let values: Vec<f64> = (0..d[0] * d[1])
        .map(|i| {
            let (r, col) = ((i / d[1]) as i64, (i % d[1]) as i64);
            if col - r == k {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    let t = c.constant(DenseHostTensor::from_slice(&values, d.as_slice())?);
    Ok(vec![c.cast(&t, dtype)?])
}

fn scatter_elements(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let idx = c.cast(&c.input(1)?, DType::I64)?;
    let updates = c.input(2)?;
    let a = axis(c.attr_int("axis", 0), dims(&x).len())?;
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", a as i64);
    let zeros_meta = x.metadata().clone();
    let zeros =
        c.constant(HostTensor::filled(Scalar::F64(0.0).cast(x.dtype()), &zeros_meta).to_dense()?);
    let added = c.op1(
        &ops::SCATTER_ADD,
        &[zeros.clone(), idx.clone(), updates.clone()],
        &attrs,
    )?;
    match c.attr_str("reduction", "none").as_str() {
        "add" => Ok(vec![c.binary(&ops::ADD, &x, &added)?]),
        "none" => {
            // Where an index lands, the update replaces the value (indices
            // must be distinct, as ONNX requires).
            let ones_meta = updates.metadata().clone();
            let ones = c.constant(
                HostTensor::filled(Scalar::F64(1.0).cast(x.dtype()), &ones_meta).to_dense()?,
            );
            let hits = c.op1(&ops::SCATTER_ADD, &[zeros.clone(), idx, ones], &attrs)?;
            let hit = c.binary(&ops::NOT_EQUAL, &hits, &zeros)?;
            Ok(vec![c.op1(
                &ops::SELECT,
                &[hit, added, x],
                &OpAttrs::new(),
            )?])
        }
        other => Err(OnnxError::unsupported(format!(
            "ScatterElements with reduction {other}"
        ))),
    }
}

/// CenterCropPad: each listed axis is cropped or zero-padded to its target
/// length around the center (the extra element of an odd difference goes
/// after).
fn center_crop_pad(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    let shape = c
        .known_ints(1)?
        .ok_or_else(|| OnnxError::invalid("CenterCropPad needs a shape"))?;
    let axes: Vec<usize> = match c.attr_ints("axes") {
        Some(a) => a.iter().map(|&a| axis(a, d.len())).collect::<Result<_>>()?,
        None => (0..d.len()).collect(),
    };
    if shape.len() != axes.len() {
        return Err(OnnxError::invalid(format!(
            "CenterCropPad: {} lengths for {} axes",
            shape.len(),
            axes.len()
        )));
    }
    let mut before = vec![0i64; d.len()];
    let mut after = vec![0i64; d.len()];
    for (&a, &s) in axes.iter().zip(&shape) {
        let diff = s - d[a] as i64;
        if s < 0 {
            return Err(OnnxError::invalid(format!("CenterCropPad length {s}")));
        }
        // Crop: start at (n - s) / 2; pad: (s - n) / 2 before.
        let b = if diff >= 0 { diff / 2 } else { -((-diff) / 2) };
        before[a] = b;
        after[a] = diff - b;
    }
    Ok(vec![pad_with(c, &x, &before, &after, 0.0)?])
}

/// Col2Im: every block column is added back at its place in the padded
/// image by one `IndexAdd` over the image's flattened spatial dims (the
/// positions are known from the shapes), then the pads are cropped.
fn col2im(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let image = c
        .known_ints(1)?
        .ok_or_else(|| OnnxError::invalid("Col2Im needs image_shape"))?;
    let block = c
        .known_ints(2)?
        .ok_or_else(|| OnnxError::invalid("Col2Im needs block_shape"))?;
    let r = image.len();
    if block.len() != r || image.iter().chain(&block).any(|&v| v <= 0) {
        return Err(OnnxError::invalid(
            "Col2Im image_shape and block_shape differ in length or are not positive",
        ));
    }
    let get = |name: &str, n: usize, default: i64| -> Result<Vec<i64>> {
        let v = c.attr_ints(name).unwrap_or_else(|| vec![default; n]);
        if v.len() != n {
            return Err(OnnxError::invalid(format!(
                "Col2Im {name} of length {}",
                v.len()
            )));
        }
        Ok(v)
    };
    let dil = get("dilations", r, 1)?;
    let strides = get("strides", r, 1)?;
    let pads = get("pads", 2 * r, 0)?;
    let xd = dims(&x);
    if xd.len() != 3 {
        return Err(OnnxError::invalid("Col2Im needs a 3-D input"));
    }
    let k: usize = block.iter().map(|&b| b as usize).product();
    if !xd[1].is_multiple_of(k) {
        return Err(OnnxError::invalid(format!(
            "Col2Im: {} channels are not a multiple of the block size {k}",
            xd[1]
        )));
    }
    let (n, ch, l) = (xd[0], xd[1] / k, xd[2]);
    let padded: Vec<i64> = (0..r).map(|i| image[i] + pads[i] + pads[r + i]).collect();
    let blocks: Vec<i64> = (0..r)
        .map(|i| (padded[i] - (dil[i] * (block[i] - 1) + 1)) / strides[i] + 1)
        .collect();
    if blocks.iter().any(|&b| b <= 0) || blocks.iter().product::<i64>() as usize != l {
        return Err(OnnxError::invalid(format!(
            "Col2Im: {l} blocks do not match the {blocks:?} the shapes give"
        )));
    }
    // Multi-index helpers over row-major dims.
    let unravel = |mut f: i64, d: &[i64]| -> Vec<i64> {
        let mut out = vec![0; d.len()];
        for i in (0..d.len()).rev() {
            out[i] = f % d[i];
            f /= d[i];
        }
        out
    };
    let mut idx = Vec::with_capacity(k * l);
    for kb in 0..k as i64 {
        let bo = unravel(kb, &block);
        for lb in 0..l as i64 {
            let lo = unravel(lb, &blocks);
            let mut linear = 0;
            for i in 0..r {
                linear = linear * padded[i] + bo[i] * dil[i] + lo[i] * strides[i];
            }
            idx.push(linear);
        }
    }
    let total: usize = padded.iter().map(|&p| p as usize).product();
    let src = c.reshape(&x, &[n, ch, k * l])?;
    let zeros_meta = TensorMetadata::new(x.dtype(), Shape::from(vec![n, ch, total]));
    let zeros =
        c.constant(HostTensor::filled(Scalar::F64(0.0).cast(x.dtype()), &zeros_meta).to_dense()?);
    let idx = c.ints_constant(&idx)?;
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", 2);
    let y = c.op1(&ops::INDEX_ADD, &[zeros, idx, src], &attrs)?;
    let mut shape = vec![n, ch];
    shape.extend(padded.iter().map(|&p| p as usize));
    let y = c.reshape(&y, &shape)?;
    let before: Vec<i64> = [0, 0]
        .into_iter()
        .chain(pads[..r].iter().map(|&p| -p))
        .collect();
    let after: Vec<i64> = [0, 0]
        .into_iter()
        .chain(pads[r..].iter().map(|&p| -p))
        .collect();
    Ok(vec![pad_with(c, &y, &before, &after, 0.0)?])
}

/// ScatterND (reductions none and add): the indexed leading dims of the
/// data are flattened to one, each index tuple becomes a linear index,
/// and an `IndexAdd` along that dim places the updates.
fn scatter_nd(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let idx = c.cast(&c.input(1)?, DType::I64)?;
    let updates = c.input(2)?;
    let reduction = c.attr_str("reduction", "none");
    if !matches!(reduction.as_str(), "none" | "add") {
        return Err(OnnxError::unsupported(format!(
            "ScatterND with reduction {reduction}"
        )));
    }
    let d = dims(&x);
    let id = dims(&idx);
    let k = *id
        .last()
        .ok_or_else(|| OnnxError::invalid("ScatterND indices of rank 0"))?;
    if k == 0 || k > d.len() {
        return Err(OnnxError::unsupported(format!(
            "ScatterND with index tuples of length {k} into rank {}",
            d.len()
        )));
    }
    let lead: usize = d[..k].iter().product();
    let rest = &d[k..];
    let n_updates: usize = id[..id.len() - 1].iter().product();
    let mut strides = vec![1i64; k];
    for j in (0..k.saturating_sub(1)).rev() {
        strides[j] = strides[j + 1] * d[j + 1] as i64;
    }
    let sizes: Vec<i64> = d[..k].iter().map(|&v| v as i64).collect();
    let sizes = c.ints_constant(&sizes)?;
    let zero = c.scalar(0.0, DType::I64)?;
    let negative = c.binary(&ops::LESS, &idx, &zero)?;
    let wrapped = c.binary(&ops::ADD, &idx, &sizes)?;
    let idx = c.op1(&ops::SELECT, &[negative, wrapped, idx], &OpAttrs::new())?;
    let strides = c.ints_constant(&strides)?;
    let scaled = c.binary(&ops::MUL, &idx, &strides)?;
    let last = id.len() as i64 - 1;
    let linear = super::reduce::reduce_with(c, &ops::SUM, &scaled, &[last], false)?;
    let linear = c.reshape(&linear, &[n_updates])?;
    let mut flat = vec![lead];
    flat.extend_from_slice(rest);
    let mut uflat = vec![n_updates];
    uflat.extend_from_slice(rest);
    let xf = c.reshape(&x, &flat)?;
    let uf = c.reshape(&updates, &uflat)?;
    let zeros_meta = xf.metadata().clone();
    let zeros =
        c.constant(HostTensor::filled(Scalar::F64(0.0).cast(x.dtype()), &zeros_meta).to_dense()?);
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", 0);
    let added = c.op1(
        &ops::INDEX_ADD,
        &[zeros.clone(), linear.clone(), uf.clone()],
        &attrs,
    )?;
    let y = if reduction == "add" {
        c.binary(&ops::ADD, &xf, &added)?
    } else {
        let ones_meta = uf.metadata().clone();
        let ones = c
            .constant(HostTensor::filled(Scalar::F64(1.0).cast(x.dtype()), &ones_meta).to_dense()?);
        let hits = c.op1(&ops::INDEX_ADD, &[zeros.clone(), linear, ones], &attrs)?;
        let hit = c.binary(&ops::NOT_EQUAL, &hits, &zeros)?;
        c.op1(&ops::SELECT, &[hit, added, xf], &OpAttrs::new())?
    };
    Ok(vec![c.reshape(&y, &d)?])
}

fn cumprod(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let a = c
        .known_ints(1)?
        .and_then(|v| v.first().copied())
        .ok_or_else(|| OnnxError::invalid("CumProd needs an axis"))?;
    let dt = x.dtype();
    if dt == DType::Bool {
        return Err(OnnxError::unsupported("CumProd of bool tensors"));
    }
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", axis(a, dims(&x).len())? as i64);
    attrs.set_bool("exclusive", c.attr_int("exclusive", 0) != 0);
    attrs.set_bool("reverse", c.attr_int("reverse", 0) != 0);
    // In f64: the product's magnitude is exp of the running sum of
    // log |x| over the nonzero elements, its sign flips with each negative
    // element, and it is zero once a zero was seen.
    let xf = c.cast(&x, DType::F64)?;
    let zero = c.scalar(0.0, DType::F64)?;
    let one = c.scalar(1.0, DType::F64)?;
    let is_zero = c.binary(&ops::EQUAL, &xf, &zero)?;
    let is_neg = c.binary(&ops::LESS, &xf, &zero)?;
    let mag = c.unary(&ops::ABS, &xf)?;
    let safe = c.op1(
        &ops::SELECT,
        &[is_zero.clone(), one.clone(), mag],
        &OpAttrs::new(),
    )?;
    let logs = c.unary(&ops::LOG, &safe)?;
    let run = c.op1(&ops::CUMSUM, &[logs], &attrs)?;
    let magnitude = c.unary(&ops::EXP, &run)?;
    let negs = c.cast(&is_neg, DType::F64)?;
    let neg_run = c.op1(&ops::CUMSUM, &[negs], &attrs)?;
    // (-1)^n as 1 - 2 (n mod 2), with n mod 2 = n - 2 floor(n / 2).
    let half = c.with_scalar(&ops::MUL, &neg_run, 0.5)?;
    let fl = c.unary(&ops::FLOOR, &half)?;
    let twice = c.with_scalar(&ops::MUL, &fl, 2.0)?;
    let parity = c.binary(&ops::SUB, &neg_run, &twice)?;
    let p2 = c.with_scalar(&ops::MUL, &parity, 2.0)?;
    let sign = c.binary(&ops::SUB, &one, &p2)?;
    let zeros = c.cast(&is_zero, DType::F64)?;
    let zero_run = c.op1(&ops::CUMSUM, &[zeros], &attrs)?;
    let seen_zero = c.binary(&ops::GREATER, &zero_run, &zero)?;
    let signed = c.binary(&ops::MUL, &magnitude, &sign)?;
    let y = c.op1(&ops::SELECT, &[seen_zero, zero, signed], &OpAttrs::new())?;
    let y = if dt.is_float() {
        y
    } else {
        c.unary(&ops::ROUND, &y)?
    };
    Ok(vec![c.cast(&y, dt)?])
}

/// `GatherND` with `batch_dims = 0`: the index tuples along the last axis
/// of `indices` become linear indices into `data`'s leading axes, which a
/// `Gather` reads from `data` flattened over them.
/// `GatherND`: each index tuple becomes a flat index into the data's
/// first `k` axes after the `batch_dims` leading ones, offset by its batch
/// entry's block when there are batch axes, and one `Gather` reads them.
fn gather_nd(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let b = c.attr_int("batch_dims", 0);
    let data = c.input(0)?;
    let indices = c.cast(&c.input(1)?, DType::I64)?;
    let dd = dims(&data);
    let id = dims(&indices);
    if b < 0
        || b as usize >= id.len()
        || b as usize > dd.len()
        || id[..b as usize] != dd[..b as usize]
    {
        return Err(OnnxError::invalid(format!(
            "GatherND batch_dims {b} for data {dd:?} and indices {id:?}"
        )));
    }
    let b = b as usize;
    let batch: usize = dd[..b].iter().product();
    let dd = dd[b..].to_vec();
    let k = *id
        .last()
        .ok_or_else(|| OnnxError::invalid("GatherND indices need a last axis"))?;
    if k == 0 || k > dd.len() {
        return Err(OnnxError::invalid(format!(
            "GatherND index tuples of {k} into rank {}",
            dd.len()
        )));
    }
    // Negative indices count from the end of their axis.
    let sizes: Vec<i64> = dd[..k].iter().map(|&n| n as i64).collect();
    let sizes_t = c.constant(DenseHostTensor::from_slice(&sizes, [k])?);
    let zero = c.scalar(0.0, DType::I64)?;
    let neg = c.binary(&ops::LESS, &indices, &zero)?;
    let wrapped = c.binary(&ops::ADD, &indices, &sizes_t)?;
    let idx = c.op1(&ops::SELECT, &[neg, wrapped, indices], &OpAttrs::new())?;
    let mut strides = vec![1i64; k];
    for i in (0..k.saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * sizes[i + 1];
    }
    let strides_t = c.constant(DenseHostTensor::from_slice(&strides, [k])?);
    let scaled = c.binary(&ops::MUL, &idx, &strides_t)?;
    let mut sum = OpAttrs::new();
    sum.set_ints("axes", &[-1]);
    sum.set_bool("keepdim", false);
    let mut linear = c.op1(&ops::SUM, &[scaled], &sum)?;
    let outer: usize = dd[..k].iter().product();
    if b > 0 {
        // Batch entry i's tuples index its own block of `outer` rows.
        let offsets: Vec<i64> = (0..batch).map(|i| (i * outer) as i64).collect();
        let mut shape = id[..b].to_vec();
        shape.extend(std::iter::repeat_n(1, id.len() - 1 - b));
        let offsets = c.constant(DenseHostTensor::from_slice(&offsets, shape)?);
        linear = c.binary(&ops::ADD, &linear, &offsets)?;
    }
    let mut flat_dims = vec![batch * outer];
    flat_dims.extend_from_slice(&dd[k..]);
    let flat = c.reshape(&data, &flat_dims)?;
    let mut g = OpAttrs::new();
    g.set_int("axis", 0);
    Ok(vec![c.op1(&ops::GATHER, &[flat, linear], &g)?])
}
