//! Neural-network ONNX ops: `MatMul`, `Gemm`, `Conv` (1-D and 2-D),
//! pooling, `BatchNormalization` (inference), `InstanceNormalization`,
//! `LayerNormalization` and `LRN`.

use super::reduce::reduce_with;
use super::shape::{pad_with, slice_axis};
use super::{axis, dims, require_float, Ctx, Translate};
use crate::error::{OnnxError, Result};
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::{DType, DenseHostTensor};

pub(super) fn lookup(op_type: &str) -> Option<Translate> {
    Some(match op_type {
        "MatMul" => matmul,
        "Einsum" => einsum,
        "Gemm" => gemm,
        "Conv" => conv,
        "MaxPool" => |c| pool(c, true),
        "AveragePool" => |c| pool(c, false),
        "GlobalAveragePool" => |c| global_pool(c, &ops::MEAN),
        "GlobalMaxPool" => |c| global_pool(c, &ops::MAX),
        "BatchNormalization" => batch_norm,
        "InstanceNormalization" => instance_norm,
        "LayerNormalization" => layer_norm,
        "LRN" => lrn,
        "RMSNormalization" => rms_norm,
        "ConvTranspose" => conv_transpose,
        "LpPool" => lp_pool,
        "MeanVarianceNormalization" => mean_variance_norm,
        "GlobalLpPool" => global_lp_pool,
        "NegativeLogLikelihoodLoss" => nll_loss,
        "SoftmaxCrossEntropyLoss" => softmax_cross_entropy,
        "LpNormalization" => lp_norm,
        _ => return None,
    })
}

fn matmul(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let (a, b) = (c.input(0)?, c.input(1)?);
    Ok(vec![c.op1(&ops::MATMUL, &[a, b], &OpAttrs::new())?])
}

fn gemm(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let (a, b) = (c.input(0)?, c.input(1)?);
    let mut attrs = OpAttrs::new();
    attrs.set_bool("transpose_a", c.attr_int("transA", 0) != 0);
    attrs.set_bool("transpose_b", c.attr_int("transB", 0) != 0);
    let mut y = c.op1(&ops::MATMUL, &[a, b], &attrs)?;
    let alpha = c.attr_float("alpha", 1.0) as f64;
    if alpha != 1.0 {
        y = c.with_scalar(&ops::MUL, &y, alpha)?;
    }
    if let Some(bias) = c.opt_input(2) {
        let beta = c.attr_float("beta", 1.0) as f64;
        let bias = if beta != 1.0 {
            c.with_scalar(&ops::MUL, bias, beta)?
        } else {
            bias.clone()
        };
        y = c.binary(&ops::ADD, &y, &bias)?;
    }
    Ok(vec![y])
}

/// Padding of the spatial axes: `(begin, end)` per axis.
fn spatial_pads(
    c: &Ctx<'_>,
    input: &[usize],
    kernel: &[usize],
    strides: &[usize],
    dilations: &[usize],
) -> Result<Vec<(usize, usize)>> {
    let n = input.len();
    let auto = c.attr_str("auto_pad", "NOTSET");
    match auto.as_str() {
        "NOTSET" => {
            let pads = c.attr_ints("pads").unwrap_or_else(|| vec![0; 2 * n]);
            if pads.len() != 2 * n || pads.iter().any(|&p| p < 0) {
                return Err(OnnxError::invalid(format!("invalid pads {pads:?}")));
            }
            Ok((0..n)
                .map(|i| (pads[i] as usize, pads[i + n] as usize))
                .collect())
        }
        "VALID" => Ok(vec![(0, 0); n]),
        "SAME_UPPER" | "SAME_LOWER" => Ok((0..n)
            .map(|i| {
                let out = input[i].div_ceil(strides[i]);
                let span = (kernel[i] - 1) * dilations[i] + 1;
                let total = ((out.max(1) - 1) * strides[i] + span).saturating_sub(input[i]);
                let small = total / 2;
                if auto == "SAME_UPPER" {
                    (small, total - small)
                } else {
                    (total - small, small)
                }
            })
            .collect()),
        other => Err(OnnxError::unsupported(format!("auto_pad {other}"))),
    }
}

fn ints_or(c: &Ctx<'_>, name: &str, n: usize, default: usize) -> Result<Vec<usize>> {
    match c.attr_ints(name) {
        Some(v) if v.len() == n && v.iter().all(|&x| x > 0) => {
            Ok(v.iter().map(|&x| x as usize).collect())
        }
        Some(v) => Err(OnnxError::invalid(format!("invalid {name} {v:?}"))),
        None => Ok(vec![default; n]),
    }
}

/// A 1-D input `[N, C, L]` as 2-D `[N, C, 1, L]`.
fn as_2d(c: &Ctx<'_>, x: &TensorHandle) -> Result<TensorHandle> {
    let d = dims(x);
    c.reshape(x, &[d[0], d[1], 1, d[2]])
}

/// A spatial list for 2-D ops: 1-D lists get `pad1d` prepended.
fn two<T: Copy>(v: &[T], pad1d: T) -> [T; 2] {
    if v.len() == 1 {
        [pad1d, v[0]]
    } else {
        [v[0], v[1]]
    }
}

fn conv(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let w = c.input(1)?;
    Ok(vec![conv_of(c, x, w, c.opt_input(2))?])
}

/// The convolution of `x` by `w` (plus `bias`, one per output channel)
/// with the node's `Conv` attributes: `Conv` itself, and the integer
/// convolutions of `quantize.rs`, whose third input is no bias.
pub(super) fn conv_of(
    c: &Ctx<'_>,
    x: TensorHandle,
    w: TensorHandle,
    bias: Option<&TensorHandle>,
) -> Result<TensorHandle> {
    let xd = dims(&x);
    let wd = dims(&w);
    let spatial = xd.len().saturating_sub(2);
    if !(1..=3).contains(&spatial) || wd.len() != xd.len() {
        return Err(OnnxError::unsupported(format!(
            "Conv with {spatial} spatial dimensions (1 to 3 are supported)"
        )));
    }
    let kernel = &wd[2..];
    let strides = ints_or(c, "strides", spatial, 1)?;
    let dilations = ints_or(c, "dilations", spatial, 1)?;
    let pads = spatial_pads(c, &xd[2..], kernel, &strides, &dilations)?;
    if spatial == 3 {
        return conv3d(c, &x, &w, bias, &strides, &dilations, &pads);
    }
    let (mut x2, w2) = if spatial == 1 {
        (as_2d(c, &x)?, as_2d(c, &w)?)
    } else {
        (x, w)
    };
    let pads2 = two(&pads, (0, 0));
    let symmetric = pads2.iter().all(|&(b, e)| b == e);
    let padding = if symmetric {
        [pads2[0].0, pads2[1].0]
    } else {
        let before = [0, 0, pads2[0].0 as i64, pads2[1].0 as i64];
        let after = [0, 0, pads2[0].1 as i64, pads2[1].1 as i64];
        x2 = pad_with(c, &x2, &before, &after, 0.0)?;
        [0, 0]
    };
    let mut attrs = OpAttrs::new();
    attrs.set_dims("stride", &two(&strides, 1));
    attrs.set_dims("padding", &padding);
    attrs.set_dims("dilation", &two(&dilations, 1));
    attrs.set_int("groups", c.attr_int("group", 1));
    let y = c.op1(&ops::CONV2D, &[x2, w2], &attrs)?;
    add_bias_and_unfold(c, y, bias, spatial)
}

/// A 2-D convolution's result finished as the node asks: plus the optional
/// bias (one per output channel), and a 1-D convolution's dummy height (it
/// ran as 2-D) dropped again.
fn add_bias_and_unfold(
    c: &Ctx<'_>,
    y: TensorHandle,
    bias: Option<&TensorHandle>,
    spatial: usize,
) -> Result<TensorHandle> {
    let mut y = y;
    if let Some(b) = bias {
        let b = c.reshape(b, &[1, dims(&y)[1], 1, 1])?;
        y = c.binary(&ops::ADD, &y, &b)?;
    }
    if spatial == 1 {
        let d = dims(&y);
        y = c.reshape(&y, &[d[0], d[1], d[3]])?;
    }
    Ok(y)
}

/// A 3-D convolution as a sum over the kernel's depth offsets of 2-D
/// convolutions: each offset takes a strided slice of the padded input's
/// depth, folds the output depth into the batch and convolves with that
/// depth slice of the weights.
fn conv3d(
    c: &Ctx<'_>,
    x: &TensorHandle,
    w: &TensorHandle,
    bias: Option<&TensorHandle>,
    strides: &[usize],
    dilations: &[usize],
    pads: &[(usize, usize)],
) -> Result<TensorHandle> {
    let before: Vec<i64> = [0, 0]
        .into_iter()
        .chain(pads.iter().map(|p| p.0 as i64))
        .collect();
    let after: Vec<i64> = [0, 0]
        .into_iter()
        .chain(pads.iter().map(|p| p.1 as i64))
        .collect();
    let xp = pad_with(c, x, &before, &after, 0.0)?;
    let xd = dims(&xp);
    let wd = dims(w);
    let (n, ch, dp, hp, wp) = (xd[0], xd[1], xd[2], xd[3], xd[4]);
    let (m, kd) = (wd[0], wd[2]);
    let ke = dilations[0] * (kd - 1) + 1;
    if ke > dp {
        return Err(OnnxError::invalid(format!(
            "a kernel depth of {ke} over {dp} elements"
        )));
    }
    let od = (dp - ke) / strides[0] + 1;
    let slice = |t: &TensorHandle, starts: Vec<i64>, ends: Vec<i64>, steps: Vec<i64>| {
        let mut a = OpAttrs::new();
        a.set_ints("starts", &starts);
        a.set_ints("ends", &ends);
        a.set_ints("steps", &steps);
        c.op1(&ops::SLICE, std::slice::from_ref(t), &a)
    };
    let transpose = |t: &TensorHandle, perm: &[i64]| {
        let mut a = OpAttrs::new();
        a.set_ints("perm", perm);
        c.op1(&ops::TRANSPOSE, std::slice::from_ref(t), &a)
    };
    let mut attrs = OpAttrs::new();
    attrs.set_dims("stride", &strides[1..]);
    attrs.set_dims("padding", &[0, 0]);
    attrs.set_dims("dilation", &dilations[1..]);
    attrs.set_int("groups", c.attr_int("group", 1));
    let mut acc: Option<TensorHandle> = None;
    for z in 0..kd {
        let s = (z * dilations[0]) as i64;
        let e = s + ((od - 1) * strides[0]) as i64 + 1;
        let xs = slice(
            &xp,
            vec![0, 0, s, 0, 0],
            vec![n as i64, ch as i64, e, hp as i64, wp as i64],
            vec![1, 1, strides[0] as i64, 1, 1],
        )?;
        let xs = transpose(&xs, &[0, 2, 1, 3, 4])?;
        let xs = c.reshape(&xs, &[n * od, ch, hp, wp])?;
        let ws = slice(
            w,
            vec![0, 0, z as i64, 0, 0],
            vec![
                wd[0] as i64,
                wd[1] as i64,
                z as i64 + 1,
                wd[3] as i64,
                wd[4] as i64,
            ],
            vec![1, 1, 1, 1, 1],
        )?;
        let ws = c.reshape(&ws, &[wd[0], wd[1], wd[3], wd[4]])?;
        let y = c.op1(&ops::CONV2D, &[xs, ws], &attrs)?;
        acc = Some(match acc {
            None => y,
            Some(a) => c.binary(&ops::ADD, &a, &y)?,
        });
    }
    let y = acc.ok_or_else(|| OnnxError::invalid("a Conv kernel of depth 0"))?;
    let yd = dims(&y);
    let y = c.reshape(&y, &[n, od, m, yd[2], yd[3]])?;
    let mut y = transpose(&y, &[0, 2, 1, 3, 4])?;
    if let Some(b) = bias {
        let b = c.reshape(b, &[1, m, 1, 1, 1])?;
        y = c.binary(&ops::ADD, &y, &b)?;
    }
    Ok(y)
}

fn pool(c: &Ctx<'_>, max: bool) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    if max && matches!(x.dtype(), DType::U8 | DType::I8) {
        // Every 8-bit value is exact in f32 and a maximum picks one of
        // them: pooled in f32, the result casts back exactly.
        return max_pool_narrow(c, &x);
    }
    require_float(c, &x)?;
    let xd = dims(&x);
    let spatial = xd.len().saturating_sub(2);
    if !(1..=3).contains(&spatial) {
        return Err(OnnxError::unsupported(format!(
            "{} with {spatial} spatial dimensions (1 to 3 are supported)",
            c.op_type()
        )));
    }
    let kernel = ints_or(c, "kernel_shape", spatial, 1)?;
    if !c.has_attr("kernel_shape") {
        return Err(OnnxError::invalid("pooling needs kernel_shape"));
    }
    let strides = ints_or(c, "strides", spatial, 1)?;
    let dilations = ints_or(c, "dilations", spatial, 1)?;
    let mut pads = spatial_pads(c, &xd[2..], &kernel, &strides, &dilations)?;
    if max && c.node.output.get(1).is_some_and(|o| !o.is_empty()) {
        return max_pool_with_indices(c, &x, &kernel, &strides, &dilations, &pads);
    }
    if spatial == 3 || dilations.iter().any(|&d| d != 1) {
        return pool_by_slices(c, &x, max, false, &kernel, &strides, &dilations, &pads);
    }
    // The end padding ceil_mode adds, which an average never counts.
    let mut ceil_ext = vec![0usize; spatial];
    if c.attr_int("ceil_mode", 0) != 0 {
        // Grow the end padding so the floor of the output size is the
        // ceiling the model asks for; the last window must start inside
        // the input or its begin padding.
        for i in 0..spatial {
            let (b, e) = pads[i];
            let padded = xd[2 + i] + b + e;
            let mut out = (padded - kernel[i]).div_ceil(strides[i]) + 1;
            if (out - 1) * strides[i] >= xd[2 + i] + b {
                out -= 1;
            }
            let need = (out - 1) * strides[i] + kernel[i];
            if need > padded {
                ceil_ext[i] = need - padded;
            }
        }
    }
    let count_include_pad = c.attr_int("count_include_pad", 0) != 0;
    let mut x2 = if spatial == 1 { as_2d(c, &x)? } else { x };
    if !max
        && (ceil_ext.iter().any(|&e| e > 0)
            || !count_include_pad
                && pads
                    .iter()
                    .zip(&kernel)
                    .any(|(&(b, e), &k)| b != e || b * 2 > k))
    {
        let ext2 = two(&ceil_ext, 0);
        return average_by_mask(
            c,
            &x2,
            &two(&pads, (0, 0)),
            &ext2,
            &kernel,
            &strides,
            count_include_pad,
            spatial,
        );
    }
    for i in 0..spatial {
        pads[i].1 += ceil_ext[i];
    }
    let pads2 = two(&pads, (0, 0));
    let kernel2 = two(&kernel, 1);
    let fits = pads2
        .iter()
        .zip(&kernel2)
        .all(|(&(b, e), &k)| b == e && b * 2 <= k);
    let padding = if fits {
        [pads2[0].0, pads2[1].0]
    } else {
        let value = if max { f64::NEG_INFINITY } else { 0.0 };
        let before = [0, 0, pads2[0].0 as i64, pads2[1].0 as i64];
        let after = [0, 0, pads2[0].1 as i64, pads2[1].1 as i64];
        x2 = pad_with(c, &x2, &before, &after, value)?;
        [0, 0]
    };
    let mut attrs = OpAttrs::new();
    attrs.set_dims("kernel", &kernel2);
    attrs.set_dims("stride", &two(&strides, 1));
    attrs.set_dims("padding", &padding);
    let op = if max {
        &ops::MAX_POOL2D
    } else {
        attrs.set_bool("count_include_pad", count_include_pad);
        &ops::AVG_POOL2D
    };
    let mut y = c.op1(op, &[x2], &attrs)?;
    if spatial == 1 {
        let d = dims(&y);
        y = c.reshape(&y, &[d[0], d[1], d[3]])?;
    }
    Ok(vec![y])
}

/// `MaxPool` of 8-bit integers through f32 (see [`pool`]); the node's
/// input is swapped for its f32 copy, so every pooling path serves.
fn max_pool_narrow(c: &Ctx<'_>, x: &TensorHandle) -> Result<Vec<TensorHandle>> {
    let wide = c.cast(x, DType::F32)?;
    let mut inputs = c.inputs_vals();
    if let Some(Some(v)) = inputs.get_mut(0) {
        v.handle = wide;
        v.known = None;
    }
    let sub = c.with_inputs(inputs);
    let outs = pool(&sub, true)?;
    let mut outs = outs.into_iter();
    let y = outs
        .next()
        .ok_or_else(|| OnnxError::invalid("MaxPool produced no output"))?;
    let mut result = vec![c.cast(&y, x.dtype())?];
    result.extend(outs);
    Ok(result)
}

/// `MaxPool` with its second output, the flat index of each maximum in
/// its `[N, C, ...]` input (row-major; column-major over the spatial axes
/// with `storage_order = 1`). One strided slice of the `-inf`-padded input
/// per kernel offset, each with a constant table of the input positions it
/// reads; a running maximum keeps the first offset reaching it and that
/// offset's positions.
fn max_pool_with_indices(
    c: &Ctx<'_>,
    x: &TensorHandle,
    kernel: &[usize],
    strides: &[usize],
    dilations: &[usize],
    pads: &[(usize, usize)],
) -> Result<Vec<TensorHandle>> {
    if c.attr_int("ceil_mode", 0) != 0 {
        return Err(OnnxError::unsupported(
            "MaxPool's indices output with ceil_mode",
        ));
    }
    let column_major = c.attr_int("storage_order", 0) != 0;
    let xd = dims(x);
    let spatial = kernel.len();
    let sp = &xd[2..];
    let mut out = vec![0usize; spatial];
    for i in 0..spatial {
        let ke = dilations[i] * (kernel[i] - 1) + 1;
        let padded = sp[i] + pads[i].0 + pads[i].1;
        if ke > padded {
            return Err(OnnxError::invalid(format!(
                "a pooling window of {ke} over {padded} elements"
            )));
        }
        out[i] = (padded - ke) / strides[i] + 1;
    }
    let before: Vec<i64> = [0, 0]
        .into_iter()
        .chain(pads.iter().map(|p| p.0 as i64))
        .collect();
    let after: Vec<i64> = [0, 0]
        .into_iter()
        .chain(pads.iter().map(|p| p.1 as i64))
        .collect();
    let xp = pad_with(c, x, &before, &after, f64::NEG_INFINITY)?;
    // The flat stride of each spatial axis.
    let mut stride_of = vec![1usize; spatial];
    if column_major {
        for i in 1..spatial {
            stride_of[i] = stride_of[i - 1] * sp[i - 1];
        }
    } else {
        for i in (0..spatial.saturating_sub(1)).rev() {
            stride_of[i] = stride_of[i + 1] * sp[i + 1];
        }
    }
    let positions: usize = out.iter().product();
    let mut table_shape = vec![1, 1];
    table_shape.extend(&out);
    let mut acc: Option<(TensorHandle, TensorHandle)> = None;
    for flat in 0..kernel.iter().product::<usize>() {
        let mut offset = vec![0usize; spatial];
        let mut r = flat;
        for i in (0..spatial).rev() {
            offset[i] = r % kernel[i];
            r /= kernel[i];
        }
        let w = window_at(c, &xp, &offset, (dilations, strides, &out))?;
        // The input position each output position reads at this offset
        // (a padded one reads -inf, so its index is never taken unless
        // the whole window is padding).
        let table: Vec<i64> = (0..positions)
            .map(|p| {
                let mut rest = p;
                let mut at = 0i64;
                for i in (0..spatial).rev() {
                    let o = rest % out[i];
                    rest /= out[i];
                    let h = (o * strides[i] + offset[i] * dilations[i]) as i64 - pads[i].0 as i64;
                    at += h.clamp(0, sp[i] as i64 - 1) * stride_of[i] as i64;
                }
                at
            })
            .collect();
        let t = c.constant(DenseHostTensor::from_slice(&table, table_shape.clone())?);
        acc = Some(match acc {
            None => {
                let mut b = OpAttrs::new();
                b.set_dims("shape", &dims(&w));
                (w.clone(), c.op1(&ops::BROADCAST_TO, &[t], &b)?)
            }
            Some((m, idx)) => {
                let better = c.binary(&ops::GREATER, &w, &m)?;
                let m = c.op1(&ops::SELECT, &[better.clone(), w, m], &OpAttrs::new())?;
                let idx = c.op1(&ops::SELECT, &[better, t, idx], &OpAttrs::new())?;
                (m, idx)
            }
        });
    }
    let (y, idx) = acc.ok_or_else(|| OnnxError::invalid("an empty pooling kernel"))?;
    // Each (n, c) plane starts at (n·C + c) · its size.
    let plane: usize = sp.iter().product();
    let bases: Vec<i64> = (0..xd[0] * xd[1]).map(|i| (i * plane) as i64).collect();
    let mut base_shape = vec![xd[0], xd[1]];
    base_shape.extend(std::iter::repeat_n(1, spatial));
    let bases = c.constant(DenseHostTensor::from_slice(&bases, base_shape)?);
    Ok(vec![y, c.binary(&ops::ADD, &idx, &bases)?])
}

/// The values of the padded input `t: [N, C, spatial..]` that the window
/// tap at `offset` reads for every output position: a strided slice with
/// `out` positions per spatial axis.
fn window_at(
    c: &Ctx<'_>,
    t: &TensorHandle,
    offset: &[usize],
    (dilations, strides, out): (&[usize], &[usize], &[usize]),
) -> Result<TensorHandle> {
    let d = dims(t);
    let mut starts = vec![0i64, 0];
    let mut ends = vec![d[0] as i64, d[1] as i64];
    let mut steps = vec![1i64, 1];
    for i in 0..out.len() {
        let s = (offset[i] * dilations[i]) as i64;
        starts.push(s);
        ends.push(s + ((out[i] - 1) * strides[i]) as i64 + 1);
        steps.push(strides[i] as i64);
    }
    let mut a = OpAttrs::new();
    a.set_ints("starts", &starts);
    a.set_ints("ends", &ends);
    a.set_ints("steps", &steps);
    c.op1(&ops::SLICE, std::slice::from_ref(t), &a)
}

/// Pooling of any rank with dilations, composed from strided slices: one
/// slice of the padded input per kernel offset, combined with a maximum,
/// or summed and divided by the same sum over a mask of the elements that
/// count (the input, and the explicit pads when `count_include_pad`), or
/// only summed when `sum` (LpPool's sum of powers).
#[allow(clippy::too_many_arguments)]
fn pool_by_slices(
    c: &Ctx<'_>,
    x: &TensorHandle,
    max: bool,
    sum: bool,
    kernel: &[usize],
    strides: &[usize],
    dilations: &[usize],
    pads: &[(usize, usize)],
) -> Result<Vec<TensorHandle>> {
    let xd = dims(x);
    let spatial = kernel.len();
    let ceil = c.attr_int("ceil_mode", 0) != 0;
    let mut out = vec![0usize; spatial];
    let mut ext = vec![0usize; spatial];
    for i in 0..spatial {
        let (b, e) = pads[i];
        let n = xd[2 + i];
        let ke = dilations[i] * (kernel[i] - 1) + 1;
        let padded = n + b + e;
        if ke > padded {
            return Err(OnnxError::invalid(format!(
                "a pooling window of {ke} over {padded} elements"
            )));
        }
        let mut o = if ceil {
            (padded - ke).div_ceil(strides[i]) + 1
        } else {
            (padded - ke) / strides[i] + 1
        };
        if ceil && o > 1 && (o - 1) * strides[i] >= n + b {
            o -= 1;
        }
        out[i] = o;
        ext[i] = ((o - 1) * strides[i] + ke).saturating_sub(padded);
    }
    let mut before = vec![0i64; 2];
    let mut after = vec![0i64; 2];
    for i in 0..spatial {
        before.push(pads[i].0 as i64);
        after.push((pads[i].1 + ext[i]) as i64);
    }
    let fill = if max { f64::NEG_INFINITY } else { 0.0 };
    let xp = pad_with(c, x, &before, &after, fill)?;
    let mask = if max || sum {
        None
    } else {
        let ones = c.scalar(1.0, x.dtype())?;
        let mut shape = vec![1, 1];
        shape.extend_from_slice(&xd[2..]);
        let mut b = OpAttrs::new();
        b.set_dims("shape", &shape);
        let ones = c.op1(&ops::BROADCAST_TO, &[ones], &b)?;
        Some(if c.attr_int("count_include_pad", 0) != 0 {
            let explicit: Vec<i64> = (0..2 + spatial)
                .map(|i| if i < 2 { 0 } else { pads[i - 2].1 as i64 })
                .collect();
            let m = pad_with(c, &ones, &before, &explicit, 1.0)?;
            let extra: Vec<i64> = (0..2 + spatial)
                .map(|i| if i < 2 { 0 } else { ext[i - 2] as i64 })
                .collect();
            pad_with(c, &m, &vec![0; 2 + spatial], &extra, 0.0)?
        } else {
            pad_with(c, &ones, &before, &after, 0.0)?
        })
    };
    let window = |t: &TensorHandle, offset: &[usize]| -> Result<TensorHandle> {
        window_at(c, t, offset, (dilations, strides, &out))
    };
    let count: usize = kernel.iter().product();
    let mut acc: Option<TensorHandle> = None;
    let mut den: Option<TensorHandle> = None;
    for flat in 0..count {
        let mut offset = vec![0usize; spatial];
        let mut r = flat;
        for i in (0..spatial).rev() {
            offset[i] = r % kernel[i];
            r /= kernel[i];
        }
        let w = window(&xp, &offset)?;
        acc = Some(match acc {
            None => w,
            Some(a) if max => c.binary(&ops::MAXIMUM, &a, &w)?,
            Some(a) => c.binary(&ops::ADD, &a, &w)?,
        });
        if let Some(m) = &mask {
            let w = window(m, &offset)?;
            den = Some(match den {
                None => w,
                Some(a) => c.binary(&ops::ADD, &a, &w)?,
            });
        }
    }
    let acc = acc.ok_or_else(|| OnnxError::invalid("an empty pooling kernel"))?;
    Ok(vec![match den {
        Some(d) => c.binary(&ops::DIV, &acc, &d)?,
        None => acc,
    }])
}

/// An average over windows that do not count some padding: the sum over
/// each window of `x` padded with zeros, divided by the same sum over a
/// mask that is 1 where an element counts (the input, and the explicit
/// pads when `count_include_pad`), 0 elsewhere (`ceil_mode`'s extension).
#[allow(clippy::too_many_arguments)]
fn average_by_mask(
    c: &Ctx<'_>,
    x: &TensorHandle,
    pads: &[(usize, usize); 2],
    ext: &[usize; 2],
    kernel: &[usize],
    strides: &[usize],
    count_include_pad: bool,
    spatial: usize,
) -> Result<Vec<TensorHandle>> {
    let d = dims(x);
    let before = [0, 0, pads[0].0 as i64, pads[1].0 as i64];
    let after = [
        0,
        0,
        (pads[0].1 + ext[0]) as i64,
        (pads[1].1 + ext[1]) as i64,
    ];
    let xp = pad_with(c, x, &before, &after, 0.0)?;
    let ones = c.scalar(1.0, x.dtype())?;
    let mut attrs = OpAttrs::new();
    attrs.set_dims("shape", &[1, 1, d[2], d[3]]);
    let ones = c.op1(&ops::BROADCAST_TO, &[ones], &attrs)?;
    let mask = if count_include_pad {
        let m = pad_with(
            c,
            &ones,
            &before,
            &[0, 0, pads[0].1 as i64, pads[1].1 as i64],
            1.0,
        )?;
        pad_with(c, &m, &[0; 4], &[0, 0, ext[0] as i64, ext[1] as i64], 0.0)?
    } else {
        pad_with(c, &ones, &before, &after, 0.0)?
    };
    let mut attrs = OpAttrs::new();
    attrs.set_dims("kernel", &two(kernel, 1));
    attrs.set_dims("stride", &two(strides, 1));
    attrs.set_dims("padding", &[0, 0]);
    attrs.set_bool("count_include_pad", true);
    let sum = c.op1(&ops::AVG_POOL2D, &[xp], &attrs)?;
    let count = c.op1(&ops::AVG_POOL2D, &[mask], &attrs)?;
    let mut y = c.binary(&ops::DIV, &sum, &count)?;
    if spatial == 1 {
        let d = dims(&y);
        y = c.reshape(&y, &[d[0], d[1], d[3]])?;
    }
    Ok(vec![y])
}

fn global_pool(c: &Ctx<'_>, op: &'static ops::OpDef) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let rank = dims(&x).len();
    if rank < 3 {
        return Err(OnnxError::invalid("global pooling needs [N, C, ...]"));
    }
    let axes: Vec<i64> = (2..rank as i64).collect();
    Ok(vec![reduce_with(c, op, &x, &axes, true)?])
}

/// A per-channel vector `[C]` shaped to broadcast against `[N, C, ...]`.
fn per_channel(c: &Ctx<'_>, v: &TensorHandle, rank: usize) -> Result<TensorHandle> {
    let n = v.metadata().shape.numel();
    let mut d = vec![1; rank];
    if rank > 1 {
        d[1] = n;
    }
    c.reshape(v, &d)
}

fn batch_norm(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    if c.attr_int("training_mode", 0) != 0 {
        return super::norm::batch_norm_training(c);
    }
    if c.node.output.iter().skip(1).any(|o| !o.is_empty()) {
        return Err(OnnxError::unsupported(
            "BatchNormalization's running statistics outputs (training)",
        ));
    }
    let x = c.input(0)?;
    let rank = dims(&x).len();
    let eps = c.attr_float("epsilon", 1e-5) as f64;
    let dt = x.dtype();
    let param = |i: usize| -> Result<TensorHandle> {
        let p = c.cast(&c.input(i)?, dt)?;
        per_channel(c, &p, rank)
    };
    let (scale, bias, mean, var) = (param(1)?, param(2)?, param(3)?, param(4)?);
    // y = x * a + (bias - mean * a), a = scale / sqrt(var + eps)
    let v = c.with_scalar(&ops::ADD, &var, eps)?;
    let s = c.unary(&ops::SQRT, &v)?;
    let a = c.binary(&ops::DIV, &scale, &s)?;
    let ma = c.binary(&ops::MUL, &mean, &a)?;
    let shift = c.binary(&ops::SUB, &bias, &ma)?;
    let y = c.binary(&ops::MUL, &x, &a)?;
    Ok(vec![c.binary(&ops::ADD, &y, &shift)?])
}

/// `(x - mean) / sqrt(var + eps)` over `axes`, with the mean and the
/// reciprocal standard deviation (both kept with unit dimensions).
fn normalize(
    c: &Ctx<'_>,
    x: &TensorHandle,
    axes: &[i64],
    eps: f64,
) -> Result<(TensorHandle, TensorHandle, TensorHandle)> {
    let mean = reduce_with(c, &ops::MEAN, x, axes, true)?;
    let centered = c.binary(&ops::SUB, x, &mean)?;
    let sq = c.binary(&ops::MUL, &centered, &centered)?;
    let var = reduce_with(c, &ops::MEAN, &sq, axes, true)?;
    let v = c.with_scalar(&ops::ADD, &var, eps)?;
    let rstd = c.unary(&ops::RSQRT, &v)?;
    let y = c.binary(&ops::MUL, &centered, &rstd)?;
    Ok((y, mean, rstd))
}

fn instance_norm(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let rank = dims(&x).len();
    let eps = c.attr_float("epsilon", 1e-5) as f64;
    let axes: Vec<i64> = (2..rank as i64).collect();
    let (y, _, _) = normalize(c, &x, &axes, eps)?;
    let scale = per_channel(c, &c.input(1)?, rank)?;
    let bias = per_channel(c, &c.input(2)?, rank)?;
    let y = c.binary(&ops::MUL, &y, &scale)?;
    Ok(vec![c.binary(&ops::ADD, &y, &bias)?])
}

fn layer_norm(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let rank = dims(&x).len();
    let a = axis(c.attr_int("axis", -1), rank)?;
    let eps = c.attr_float("epsilon", 1e-5) as f64;
    let axes: Vec<i64> = (a as i64..rank as i64).collect();
    let (mut y, mean, rstd) = normalize(c, &x, &axes, eps)?;
    y = c.binary(&ops::MUL, &y, &c.input(1)?)?;
    if let Some(b) = c.opt_input(2) {
        y = c.binary(&ops::ADD, &y, b)?;
    }
    Ok(vec![y, mean, rstd])
}

fn lrn(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    if d.len() < 3 {
        return Err(OnnxError::invalid("LRN needs [N, C, ...]"));
    }
    let size = c.attr_int("size", 1).max(1) as usize;
    let alpha = c.attr_float("alpha", 1e-4) as f64;
    let beta = c.attr_float("beta", 0.75) as f64;
    let bias = c.attr_float("bias", 1.0) as f64;
    let sq = c.binary(&ops::MUL, &x, &x)?;
    let mut before = vec![0i64; d.len()];
    let mut after = vec![0i64; d.len()];
    before[1] = ((size - 1) / 2) as i64;
    after[1] = (size - 1).div_ceil(2) as i64;
    let padded = pad_with(c, &sq, &before, &after, 0.0)?;
    let channels = d[1];
    let mut sum = slice_axis(c, &padded, 1, 0, channels)?;
    for i in 1..size {
        let part = slice_axis(c, &padded, 1, i, i + channels)?;
        sum = c.binary(&ops::ADD, &sum, &part)?;
    }
    let scaled = c.with_scalar(&ops::MUL, &sum, alpha / size as f64)?;
    let shifted = c.with_scalar(&ops::ADD, &scaled, bias)?;
    // The usual exponents as square roots, which vectorize: a general
    // power runs through f64's `pow` one element at a time, and was 15 %
    // of GoogLeNet's inference (its two LRNs have β = 0.75, as AlexNet's,
    // ZFNet's and CaffeNet's do).
    let div = if beta == 1.0 {
        shifted
    } else if beta == 0.5 {
        c.unary(&ops::SQRT, &shifted)?
    } else if beta == 0.75 {
        let root = c.unary(&ops::SQRT, &shifted)?;
        let fourth = c.unary(&ops::SQRT, &root)?;
        c.binary(&ops::MUL, &root, &fourth)?
    } else {
        let e = c.scalar(beta, x.dtype())?;
        c.binary(&ops::POW, &shifted, &e)?
    };
    Ok(vec![c.binary(&ops::DIV, &x, &div)?])
}

fn rms_norm(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let rank = dims(&x).len();
    let a = axis(c.attr_int("axis", -1), rank)?;
    let eps = c.attr_float("epsilon", 1e-5) as f64;
    let axes: Vec<i64> = (a as i64..rank as i64).collect();
    let sq = c.binary(&ops::MUL, &x, &x)?;
    let ms = reduce_with(c, &ops::MEAN, &sq, &axes, true)?;
    let v = c.with_scalar(&ops::ADD, &ms, eps)?;
    let r = c.unary(&ops::RSQRT, &v)?;
    let y = c.binary(&ops::MUL, &x, &r)?;
    Ok(vec![c.binary(&ops::MUL, &y, &c.input(1)?)?])
}

fn lp_norm(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let a = axis(c.attr_int("axis", -1), dims(&x).len())? as i64;
    let norm = match c.attr_int("p", 2) {
        1 => {
            let m = c.unary(&ops::ABS, &x)?;
            reduce_with(c, &ops::SUM, &m, &[a], true)?
        }
        2 => {
            let sq = c.binary(&ops::MUL, &x, &x)?;
            let s = reduce_with(c, &ops::SUM, &sq, &[a], true)?;
            c.unary(&ops::SQRT, &s)?
        }
        p => return Err(OnnxError::invalid(format!("LpNormalization p = {p}"))),
    };
    // A zero norm leaves the zeros as they are.
    let zero = c.scalar(0.0, norm.dtype())?;
    let one = c.scalar(1.0, norm.dtype())?;
    let is_zero = c.binary(&ops::EQUAL, &norm, &zero)?;
    let norm = c.op1(&ops::SELECT, &[is_zero, one, norm], &OpAttrs::new())?;
    Ok(vec![c.binary(&ops::DIV, &x, &norm)?])
}

fn conv_transpose(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let w = c.input(1)?;
    let xd = dims(&x);
    let wd = dims(&w);
    let spatial = xd.len().saturating_sub(2);
    if !(1..=2).contains(&spatial) || wd.len() != xd.len() {
        return Err(OnnxError::unsupported(format!(
            "ConvTranspose with {spatial} spatial dimensions (1 and 2 are supported)"
        )));
    }
    let group = c.attr_int("group", 1);
    let kernel = &wd[2..];
    let strides = ints_or(c, "strides", spatial, 1)?;
    let dilations = ints_or(c, "dilations", spatial, 1)?;
    let out_pad: Vec<usize> = match c.attr_ints("output_padding") {
        Some(v) if v.len() == spatial && v.iter().all(|&p| p >= 0) => {
            v.iter().map(|&p| p as usize).collect()
        }
        Some(v) => return Err(OnnxError::invalid(format!("invalid output_padding {v:?}"))),
        None => vec![0; spatial],
    };
    // The full output of each axis, before padding is cut away.
    let full: Vec<usize> = (0..spatial)
        .map(|i| (xd[2 + i] - 1) * strides[i] + dilations[i] * (kernel[i] - 1) + 1)
        .collect();
    let auto = c.attr_str("auto_pad", "NOTSET");
    let output_shape = c.attr_ints("output_shape");
    // (begin, end) cut from each axis; a negative end extends it.
    let pads: Vec<(i64, i64)> = if output_shape.is_some() || auto.starts_with("SAME") {
        let target: Vec<i64> = match &output_shape {
            Some(o) => o[o.len().saturating_sub(spatial)..].to_vec(),
            None => (0..spatial)
                .map(|i| (xd[2 + i] * strides[i]) as i64)
                .collect(),
        };
        (0..spatial)
            .map(|i| {
                let total = (full[i] + out_pad[i]) as i64 - target[i];
                if total < 0 {
                    (0, total)
                } else if auto == "SAME_LOWER" {
                    (total - total / 2, total / 2)
                } else {
                    (total / 2, total - total / 2)
                }
            })
            .collect()
    } else if auto == "VALID" || auto == "NOTSET" {
        let p = c.attr_ints("pads").unwrap_or_else(|| vec![0; 2 * spatial]);
        if p.len() != 2 * spatial || p.iter().any(|&v| v < 0) {
            return Err(OnnxError::invalid(format!("invalid pads {p:?}")));
        }
        (0..spatial).map(|i| (p[i], p[i + spatial])).collect()
    } else {
        return Err(OnnxError::unsupported(format!("auto_pad {auto}")));
    };
    let (x2, w2) = if spatial == 1 {
        (as_2d(c, &x)?, as_2d(c, &w)?)
    } else {
        (x, w)
    };
    let mut attrs = OpAttrs::new();
    attrs.set_dims("stride", &two(&strides, 1));
    attrs.set_dims("padding", &[0, 0]);
    attrs.set_dims("output_padding", &[0, 0]);
    attrs.set_dims("dilation", &two(&dilations, 1));
    attrs.set_int("groups", group);
    let y = c.op1(&ops::CONV_TRANSPOSE2D, &[x2, w2], &attrs)?;
    // Cut the padding away (negative pads crop) and add output_padding.
    let pads2 = two(&pads, (0, 0));
    let op2 = two(&out_pad, 0);
    let before = [0, 0, -pads2[0].0, -pads2[1].0];
    let after = [0, 0, op2[0] as i64 - pads2[0].1, op2[1] as i64 - pads2[1].1];
    let y = pad_with(c, &y, &before, &after, 0.0)?;
    Ok(vec![add_bias_and_unfold(c, y, c.opt_input(2), spatial)?])
}

/// The negative log-likelihood of `log_prob: [N, C, ...]` at `target:
/// [N, ...]`, with the optional class `weight`, `ignore_index` and
/// `reduction` of the node.
fn nll(
    c: &Ctx<'_>,
    log_prob: &TensorHandle,
    target: &TensorHandle,
    weight: Option<&TensorHandle>,
) -> Result<TensorHandle> {
    let td = dims(target);
    let dt = log_prob.dtype();
    let target = c.cast(target, stagecraft_tensor::DType::I64)?;
    let (target, keep) = if c.has_attr("ignore_index") {
        let ignore = c.scalar(c.attr_int("ignore_index", 0) as f64, target.dtype())?;
        let keep = c.binary(&ops::NOT_EQUAL, &target, &ignore)?;
        let zero = c.scalar(0.0, target.dtype())?;
        let safe = c.op1(&ops::SELECT, &[keep.clone(), target, zero], &OpAttrs::new())?;
        (safe, Some(c.cast(&keep, dt)?))
    } else {
        (target, None)
    };
    // picked[n, ...] = log_prob[n, target[n, ...], ...]
    let mut idx_dims = td.clone();
    idx_dims.insert(1, 1);
    let idx = c.reshape(&target, &idx_dims)?;
    let mut g = OpAttrs::new();
    g.set_int("axis", 1);
    let picked = c.op1(&ops::GATHER_ELEMENTS, &[log_prob.clone(), idx], &g)?;
    let picked = c.reshape(&picked, &td)?;
    let mut loss = c.unary(&ops::NEG, &picked)?;
    // The weight of each element: weight[target] (0 where ignored).
    let mut w = match weight {
        Some(wt) => {
            let mut a = OpAttrs::new();
            a.set_int("axis", 0);
            Some(c.op1(&ops::GATHER, &[wt.clone(), target.clone()], &a)?)
        }
        None => None,
    };
    if let Some(k) = &keep {
        w = Some(match w {
            Some(w) => c.binary(&ops::MUL, &w, k)?,
            None => k.clone(),
        });
    }
    if let Some(w) = &w {
        loss = c.binary(&ops::MUL, &loss, w)?;
    }
    match c.attr_str("reduction", "mean").as_str() {
        "none" => Ok(loss),
        "sum" => super::reduce::reduce_with(c, &ops::SUM, &loss, &[], false),
        "mean" => {
            let total = super::reduce::reduce_with(c, &ops::SUM, &loss, &[], false)?;
            let count = match &w {
                Some(w) => super::reduce::reduce_with(c, &ops::SUM, w, &[], false)?,
                None => c.scalar(td.iter().product::<usize>() as f64, dt)?,
            };
            c.binary(&ops::DIV, &total, &count)
        }
        other => Err(OnnxError::invalid(format!("reduction {other}"))),
    }
}

fn nll_loss(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    Ok(vec![nll(c, &x, &c.input(1)?, c.opt_input(2))?])
}

fn softmax_cross_entropy(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", 1);
    let log_prob = c.op1(&ops::LOG_SOFTMAX, &[x], &attrs)?;
    let loss = nll(c, &log_prob, &c.input(1)?, c.opt_input(2))?;
    Ok(vec![loss, log_prob])
}

/// `|x|^p`.
fn abs_pow(c: &Ctx<'_>, x: &TensorHandle, p: f64) -> Result<TensorHandle> {
    let a = c.unary(&ops::ABS, x)?;
    let e = c.scalar(p, x.dtype())?;
    c.binary(&ops::POW, &a, &e)
}

fn lp_pool(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let xd = dims(&x);
    let spatial = xd.len().saturating_sub(2);
    if !(1..=3).contains(&spatial) {
        return Err(OnnxError::unsupported(format!(
            "LpPool with {spatial} spatial dimensions (1 to 3 are supported)"
        )));
    }
    if !c.has_attr("kernel_shape") {
        return Err(OnnxError::invalid("LpPool needs kernel_shape"));
    }
    if c.attr_int("ceil_mode", 0) != 0 {
        return Err(OnnxError::unsupported("LpPool with ceil_mode"));
    }
    let kernel = ints_or(c, "kernel_shape", spatial, 1)?;
    let strides = ints_or(c, "strides", spatial, 1)?;
    let dilations = ints_or(c, "dilations", spatial, 1)?;
    let pads = spatial_pads(c, &xd[2..], &kernel, &strides, &dilations)?;
    let p = c.attr_int("p", 2) as f64;
    if spatial == 3 || dilations.iter().any(|&d| d != 1) {
        let powered = abs_pow(c, &x, p)?;
        let sum = pool_by_slices(
            c, &powered, false, true, &kernel, &strides, &dilations, &pads,
        )?
        .remove(0);
        let e = c.scalar(1.0 / p, sum.dtype())?;
        return Ok(vec![c.binary(&ops::POW, &sum, &e)?]);
    }
    let x2 = if spatial == 1 { as_2d(c, &x)? } else { x };
    let powered = abs_pow(c, &x2, p)?;
    let pads2 = two(&pads, (0, 0));
    let before = [0, 0, pads2[0].0 as i64, pads2[1].0 as i64];
    let after = [0, 0, pads2[0].1 as i64, pads2[1].1 as i64];
    let padded = pad_with(c, &powered, &before, &after, 0.0)?;
    let kernel2 = two(&kernel, 1);
    let mut attrs = OpAttrs::new();
    attrs.set_dims("kernel", &kernel2);
    attrs.set_dims("stride", &two(&strides, 1));
    attrs.set_dims("padding", &[0, 0]);
    attrs.set_bool("count_include_pad", true);
    let mean = c.op1(&ops::AVG_POOL2D, &[padded], &attrs)?;
    let sum = c.with_scalar(&ops::MUL, &mean, (kernel2[0] * kernel2[1]) as f64)?;
    let e = c.scalar(1.0 / p, sum.dtype())?;
    let mut y = c.binary(&ops::POW, &sum, &e)?;
    if spatial == 1 {
        let d = dims(&y);
        y = c.reshape(&y, &[d[0], d[1], d[3]])?;
    }
    Ok(vec![y])
}

fn global_lp_pool(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let rank = dims(&x).len();
    let p = c.attr_int("p", 2) as f64;
    let powered = abs_pow(c, &x, p)?;
    let axes: Vec<i64> = (2..rank as i64).collect();
    let sum = reduce_with(c, &ops::SUM, &powered, &axes, true)?;
    let e = c.scalar(1.0 / p, sum.dtype())?;
    Ok(vec![c.binary(&ops::POW, &sum, &e)?])
}

fn mean_variance_norm(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let axes = c.attr_ints("axes").unwrap_or_else(|| vec![0, 2, 3]);
    let (y, _, _) = normalize(c, &x, &axes, 1e-9)?;
    Ok(vec![y])
}

/// An operand whose term repeats a subscript, reduced to its diagonal over
/// each repeated pair (the product with an identity mask, summed over the
/// second axis), with the term's second occurrence removed.
fn diagonals(c: &Ctx<'_>, term: &[char], x: &TensorHandle) -> Result<(Vec<char>, TensorHandle)> {
    let mut t = term.to_vec();
    let mut x = x.clone();
    while let Some((p, q)) = (0..t.len())
        .flat_map(|q| (0..q).map(move |p| (p, q)))
        .find(|&(p, q)| t[p] == t[q])
    {
        let d = dims(&x);
        if d.len() != t.len() || d[p] != d[q] {
            return Err(OnnxError::invalid(format!(
                "Einsum subscript {} repeats over axes of {} and {}",
                t[p],
                d.get(p).copied().unwrap_or(0),
                d.get(q).copied().unwrap_or(0)
            )));
        }
        let n = d[p];
        let eye: Vec<f64> = (0..n * n)
            .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
            .collect();
        let mut shape = vec![1; d.len()];
        shape[p] = n;
        shape[q] = n;
        let eye = c.constant(DenseHostTensor::from_slice(&eye, shape)?);
        let eye = c.cast(&eye, x.dtype())?;
        let masked = c.binary(&ops::MUL, &x, &eye)?;
        x = reduce_with(c, &ops::SUM, &masked, &[q as i64], false)?;
        t.remove(q);
    }
    Ok((t, x))
}

/// An Einsum equation with each `...` replaced by letters the equation
/// does not use: one per broadcast dimension, right-aligned across the
/// operands as NumPy aligns them. An implicit output lists the ellipsis's
/// letters first, then the subscripts used once in alphabetical order.
fn expand_ellipsis(equation: &str, inputs: &[TensorHandle]) -> Result<String> {
    if !equation.contains("...") {
        return Ok(equation.to_string());
    }
    let (lhs, rhs) = match equation.split_once("->") {
        Some((l, r)) => (l, Some(r)),
        None => (equation, None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != inputs.len() {
        return Err(OnnxError::invalid(format!(
            "Einsum equation {equation} names {} operands, the node has {}",
            terms.len(),
            inputs.len()
        )));
    }
    let spans: Vec<usize> = terms
        .iter()
        .zip(inputs)
        .map(|(t, x)| {
            let named = t.replace("...", "").chars().count();
            if t.contains("...") {
                dims(x).len().checked_sub(named).ok_or_else(|| {
                    OnnxError::invalid(format!(
                        "Einsum term {t} for an operand of rank {}",
                        dims(x).len()
                    ))
                })
            } else {
                Ok(0)
            }
        })
        .collect::<Result<_>>()?;
    let width = spans.iter().copied().max().unwrap_or(0);
    let free: Vec<char> = ('A'..='Z')
        .chain('a'..='z')
        .filter(|ch| !equation.contains(*ch))
        .take(width)
        .collect();
    if free.len() < width {
        return Err(OnnxError::unsupported(
            "Einsum with more broadcast dimensions than free letters",
        ));
    }
    let ell = |k: usize| -> String { free[width - k..].iter().collect() };
    let new_terms: Vec<String> = terms
        .iter()
        .zip(&spans)
        .map(|(t, &k)| t.replace("...", &ell(k)))
        .collect();
    let output = match rhs {
        Some(r) => r.replace("...", &ell(width)),
        None => {
            let joined: String = terms.concat().replace("...", "");
            let mut once: Vec<char> = joined
                .chars()
                .filter(|ch| joined.matches(*ch).count() == 1)
                .collect();
            once.sort_unstable();
            let mut o = ell(width);
            o.extend(once);
            o
        }
    };
    Ok(format!("{}->{output}", new_terms.join(",")))
}

/// `Einsum`: ellipses become fresh subscripts ([`expand_ellipsis`]), a
/// subscript repeated in one operand takes that operand's diagonal, then
/// every operand is laid out over all subscripts (missing ones as unit
/// axes), the operands are multiplied with broadcasting, the subscripts
/// not in the output are summed, and the rest put in the output's order.
/// Simple and exact, not fast: large contractions deserve a `MatMul`.
fn einsum(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let equation: String = c
        .attr_str("equation", "")
        .chars()
        .filter(|ch| !ch.is_whitespace())
        .collect();
    let equation = expand_ellipsis(&equation, &c.inputs())?;
    let (lhs, rhs) = match equation.split_once("->") {
        Some((l, r)) => (l.to_string(), Some(r.to_string())),
        None => (equation.clone(), None),
    };
    let terms: Vec<Vec<char>> = lhs.split(',').map(|t| t.chars().collect()).collect();
    let inputs = c.inputs();
    if terms.len() != inputs.len() {
        return Err(OnnxError::invalid(format!(
            "Einsum equation {equation} names {} operands, the node has {}",
            terms.len(),
            inputs.len()
        )));
    }
    let mut all: Vec<char> = Vec::new();
    for t in &terms {
        for &ch in t {
            if !ch.is_ascii_alphabetic() {
                return Err(OnnxError::invalid(format!("Einsum subscript {ch:?}")));
            }
            if !all.contains(&ch) {
                all.push(ch);
            }
        }
    }
    let output: Vec<char> = match rhs {
        Some(r) => r.chars().collect(),
        None => {
            let mut once: Vec<char> = all
                .iter()
                .copied()
                .filter(|ch| terms.iter().flatten().filter(|x| *x == ch).count() == 1)
                .collect();
            once.sort_unstable();
            once
        }
    };
    if output.iter().any(|ch| !all.contains(ch)) {
        return Err(OnnxError::invalid(format!(
            "Einsum output of {equation} names an unknown subscript"
        )));
    }
    // Output subscripts first, then the summed ones.
    let mut order: Vec<char> = output.clone();
    order.extend(all.iter().copied().filter(|ch| !output.contains(ch)));
    let mut product: Option<TensorHandle> = None;
    for (t, x) in terms.iter().zip(&inputs) {
        let (t, x) = diagonals(c, t, x)?;
        let (t, x) = (&t, &x);
        let d = dims(x);
        if t.len() != d.len() {
            return Err(OnnxError::invalid(format!(
                "Einsum term {} for an operand of rank {}",
                t.iter().collect::<String>(),
                d.len()
            )));
        }
        // Permute the operand's axes into `order`, then insert unit axes.
        let mut perm: Vec<i64> = Vec::new();
        for ch in &order {
            if let Some(i) = t.iter().position(|x| x == ch) {
                perm.push(i as i64);
            }
        }
        let mut a = OpAttrs::new();
        a.set_ints("perm", &perm);
        let y = if perm.iter().enumerate().all(|(i, &p)| p == i as i64) {
            x.clone()
        } else {
            c.op1(&ops::TRANSPOSE, std::slice::from_ref(x), &a)?
        };
        let full: Vec<usize> = order
            .iter()
            .map(|ch| t.iter().position(|x| x == ch).map_or(1, |i| d[i]))
            .collect();
        let y = c.reshape(&y, &full)?;
        product = Some(match product {
            Some(p) => c.binary(&ops::MUL, &p, &y)?,
            None => y,
        });
    }
    let product = product.ok_or_else(|| OnnxError::invalid("Einsum without operands"))?;
    let summed: Vec<i64> = (output.len()..order.len()).map(|i| i as i64).collect();
    if summed.is_empty() {
        return Ok(vec![product]);
    }
    let mut a = OpAttrs::new();
    a.set_ints("axes", &summed);
    a.set_bool("keepdim", false);
    let y = c.op1(&ops::SUM, &[product], &a)?;
    Ok(vec![y])
}
