//! Reference convolution and pooling: direct loops over every output
//! element and window tap, in f64.

/// Direct 2-D cross-correlation (NCHW input, OIHW weights).
#[allow(clippy::too_many_arguments)]
pub fn conv2d(
    x: &[f64],
    xd: [usize; 4],
    w: &[f64],
    wd: [usize; 4],
    stride: [usize; 2],
    pad: [usize; 2],
    dil: [usize; 2],
    groups: usize,
) -> Vec<f64> {
    let [n, c, h, wi] = xd;
    let [o, cg, kh, kw] = wd;
    let oh = (h + 2 * pad[0] - dil[0] * (kh - 1) - 1) / stride[0] + 1;
    let ow = (wi + 2 * pad[1] - dil[1] * (kw - 1) - 1) / stride[1] + 1;
    let og = o / groups;
    let mut out = vec![0.0; n * o * oh * ow];
    for b in 0..n {
        for oc in 0..o {
            let g = oc / og;
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut s = 0.0;
                    for ci in 0..cg {
                        let ic = g * cg + ci;
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (oy * stride[0] + ky * dil[0]) as isize - pad[0] as isize;
                                let ix = (ox * stride[1] + kx * dil[1]) as isize - pad[1] as isize;
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < wi {
                                    s += x[((b * c + ic) * h + iy as usize) * wi + ix as usize]
                                        * w[((oc * cg + ci) * kh + ky) * kw + kx];
                                }
                            }
                        }
                    }
                    out[((b * o + oc) * oh + oy) * ow + ox] = s;
                }
            }
        }
    }
    out
}

/// Direct transposed 2-D convolution (NCHW input, `[C, O/groups, KH, KW]`
/// weights): every input pixel times every tap is added at the output
/// position the tap reaches, `iy·stride + ky·dilation - padding`. Returns
/// the values and the output dimensions (PyTorch's formula).
#[allow(clippy::too_many_arguments)]
pub fn conv_transpose2d(
    x: &[f64],
    xd: [usize; 4],
    w: &[f64],
    wd: [usize; 4],
    stride: [usize; 2],
    pad: [usize; 2],
    output_pad: [usize; 2],
    dil: [usize; 2],
    groups: usize,
) -> (Vec<f64>, Vec<usize>) {
    let [n, c, h, wi] = xd;
    let [_, og, kh, kw] = wd;
    let o = og * groups;
    let cg = c / groups;
    let oh = (h - 1) * stride[0] + dil[0] * (kh - 1) + output_pad[0] + 1 - 2 * pad[0];
    let ow = (wi - 1) * stride[1] + dil[1] * (kw - 1) + output_pad[1] + 1 - 2 * pad[1];
    let mut out = vec![0.0; n * o * oh * ow];
    for b in 0..n {
        for ic in 0..c {
            let g = ic / cg;
            for iy in 0..h {
                for ix in 0..wi {
                    let v = x[((b * c + ic) * h + iy) * wi + ix];
                    for oc_in in 0..og {
                        let oc = g * og + oc_in;
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let y = (iy * stride[0] + ky * dil[0]) as isize - pad[0] as isize;
                                let xx = (ix * stride[1] + kx * dil[1]) as isize - pad[1] as isize;
                                if y >= 0 && xx >= 0 && (y as usize) < oh && (xx as usize) < ow {
                                    out[((b * o + oc) * oh + y as usize) * ow + xx as usize] +=
                                        v * w[((ic * og + oc_in) * kh + ky) * kw + kx];
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    (out, vec![n, o, oh, ow])
}

fn pool(
    x: &[f64],
    xd: [usize; 4],
    k: [usize; 2],
    stride: [usize; 2],
    pad: [usize; 2],
    f: impl Fn(&[f64]) -> f64,
) -> Vec<f64> {
    let [n, c, h, w] = xd;
    let oh = (h + 2 * pad[0] - k[0]) / stride[0] + 1;
    let ow = (w + 2 * pad[1] - k[1]) / stride[1] + 1;
    let mut out = Vec::with_capacity(n * c * oh * ow);
    for p in 0..n * c {
        for oy in 0..oh {
            for ox in 0..ow {
                let mut taps = Vec::new();
                for ky in 0..k[0] {
                    for kx in 0..k[1] {
                        let iy = (oy * stride[0] + ky) as isize - pad[0] as isize;
                        let ix = (ox * stride[1] + kx) as isize - pad[1] as isize;
                        if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                            taps.push(x[(p * h + iy as usize) * w + ix as usize]);
                        }
                    }
                }
                out.push(f(&taps));
            }
        }
    }
    out
}

/// Max pooling; padding never wins.
pub fn max_pool2d(
    x: &[f64],
    xd: [usize; 4],
    k: [usize; 2],
    stride: [usize; 2],
    pad: [usize; 2],
) -> Vec<f64> {
    pool(x, xd, k, stride, pad, |t| {
        t.iter().copied().fold(f64::NEG_INFINITY, f64::max)
    })
}

/// Average pooling; with `include_pad` the divisor is the full window.
pub fn avg_pool2d(
    x: &[f64],
    xd: [usize; 4],
    k: [usize; 2],
    stride: [usize; 2],
    pad: [usize; 2],
    include_pad: bool,
) -> Vec<f64> {
    pool(x, xd, k, stride, pad, |t| {
        let d = if include_pad {
            k[0] * k[1]
        } else {
            t.len().max(1)
        };
        t.iter().sum::<f64>() / d as f64
    })
}
