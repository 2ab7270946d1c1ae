//! Convolution (im2col + GEMM) and pooling on NCHW images.

use crate::isa::IsaLevel;
use crate::kernel::{Kernel, KernelContext, KernelRegistry, Outputs};
use crate::kernels::linalg::{gemm_into, no_epilogue, GemmElement, Layout};
use crate::Inputs;
use half::{bf16, f16};
use smallvec::{smallvec, SmallVec};
use stagecraft_ops::{conv2d_window, pool_window, Attrs, Window2d};
use stagecraft_tensor::{DType, DenseHostTensor, Element, Error, Result, TensorMetadata};
use std::sync::Arc;

pub(crate) fn register(registry: &mut KernelRegistry) {
    registry.add(&stagecraft_ops::CONV2D, conv2d_factory);
    registry.add(&stagecraft_ops::MAX_POOL2D, max_pool_factory);
    registry.add(&stagecraft_ops::AVG_POOL2D, avg_pool_factory);
    registry.add(
        &stagecraft_ops::CONV2D_BACKPROP_INPUT,
        backprop_input_factory,
    );
    registry.add(
        &stagecraft_ops::CONV2D_BACKPROP_FILTER,
        backprop_filter_factory,
    );
    // A transposed convolution computes the input gradient of the
    // convolution with the same window: `(x, w)` play the roles of `(g, w)`
    // and the output metadata carries the size `output_padding` chose.
    registry.add(&stagecraft_ops::CONV_TRANSPOSE2D, backprop_input_factory);
    registry.add(&stagecraft_ops::MAX_POOL2D_GRAD, max_pool_grad_factory);
    registry.add(&stagecraft_ops::AVG_POOL2D_GRAD, avg_pool_grad_factory);
}

/// Runs `f` on f32 copies of half-precision inputs and rounds the result
/// back, so f16/bf16 share the f32 kernels (and accumulate in f32).
fn via_f32(
    inputs: &[&DenseHostTensor],
    out: &TensorMetadata,
    f: impl Fn(&[&DenseHostTensor], &TensorMetadata) -> Result<DenseHostTensor>,
) -> Result<DenseHostTensor> {
    fn widen(t: &DenseHostTensor) -> Result<DenseHostTensor> {
        let v: Vec<f32> = match t.dtype() {
            DType::F16 => t.as_slice::<f16>()?.iter().map(|x| x.to_f32()).collect(),
            DType::BF16 => t.as_slice::<bf16>()?.iter().map(|x| x.to_f32()).collect(),
            other => return Err(Error::internal(format!("via_f32 called on {other}"))),
        };
        DenseHostTensor::from_slice(&v, t.shape().clone())
    }
    let wide: Vec<DenseHostTensor> = inputs.iter().map(|t| widen(t)).collect::<Result<_>>()?;
    let refs: Vec<&DenseHostTensor> = wide.iter().collect();
    let r = f(&refs, &TensorMetadata::new(DType::F32, out.shape.clone()))?;
    let r = r.as_slice::<f32>()?;
    match out.dtype {
        DType::F16 => DenseHostTensor::from_slice(
            &r.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(),
            out.shape.clone(),
        ),
        _ => DenseHostTensor::from_slice(
            &r.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(),
            out.shape.clone(),
        ),
    }
}

/// Defines `$name(level, args...)`, which runs `$body(args...)` with its
/// loops compiled for `level`. The build targets baseline x86-64, whose
/// SSE2 has four f32 lanes and no select: a plane loop that keeps 16
/// accumulators in registers (a max pooling's NaN-aware maximum, a
/// depthwise convolution's taps) ran there one element at a time, or four.
/// Each lane's operations are the same IEEE operations in the same order
/// at every level (no contraction into FMA), so the bits do not change.
macro_rules! multiversioned_plane {
    ($(#[$doc:meta])* fn $name:ident<T: [$($bound:tt)*] $(, const $c:ident)?>(
        $($arg:ident: $ty:ty),* $(,)?
    ) => $body:ident) => {
        $(#[$doc])*
        fn $name<T: $($bound)* $(, const $c: usize)?>(level: IsaLevel, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            fn avx2<T: $($bound)* $(, const $c: usize)?>($($arg: $ty),*) {
                $body::<T $(, $c)?>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            fn avx512<T: $($bound)* $(, const $c: usize)?>($($arg: $ty),*) {
                $body::<T $(, $c)?>($($arg),*)
            }
            match level {
                // SAFETY: `crate::isa::level` reports AVX2 only on a CPU
                // that has it, which is all `avx2` is compiled to use.
                #[cfg(target_arch = "x86_64")]
                IsaLevel::Avx2 => unsafe { avx2::<T $(, $c)?>($($arg),*) },
                // SAFETY: as above, for AVX-512F.
                #[cfg(target_arch = "x86_64")]
                IsaLevel::Avx512 => unsafe { avx512::<T $(, $c)?>($($arg),*) },
                _ => $body::<T $(, $c)?>($($arg),*),
            }
        }
    };
}

struct ConvGeometry {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    oh: usize,
    ow: usize,
    groups: usize,
    win: Window2d,
}

/// Writes the im2col matrix of one image and one channel group:
/// rows = (channel, kh, kw), columns = output pixels.
fn im2col<T: Element>(x: &[T], g: &ConvGeometry, group: usize, cols: &mut [T]) {
    im2col_columns(x, g, group, 0..g.oh * g.ow, cols);
}

/// The columns `pixels` (output pixels in row-major order) of the im2col
/// matrix of one image and channel group, into `cols`: `patch` rows of
/// `pixels.len()` values.
fn im2col_columns<T: Element>(
    x: &[T],
    g: &ConvGeometry,
    group: usize,
    pixels: std::ops::Range<usize>,
    cols: &mut [T],
) {
    let cg = g.c / g.groups;
    let (kh, kw) = (g.win.kernel[0], g.win.kernel[1]);
    let width = pixels.len();
    for ci in 0..cg {
        let plane = &x[(group * cg + ci) * g.h * g.w..][..g.h * g.w];
        for ki in 0..kh {
            for kj in 0..kw {
                let row = &mut cols[((ci * kh + ki) * kw + kj) * width..][..width];
                let dx = (kj * g.win.dilation[1]) as isize - g.win.padding[1] as isize;
                for (oy, ox0, at, run) in row_runs(pixels.clone(), g.ow) {
                    let iy = (oy * g.win.stride[0] + ki * g.win.dilation[0]) as isize
                        - g.win.padding[0] as isize;
                    if iy < 0 || iy >= g.h as isize {
                        row[at..at + run].fill(T::default());
                        continue;
                    }
                    let row_start = iy as usize * g.w;
                    if g.win.stride[1] == 1 {
                        // Contiguous taps: a copy between the padding.
                        let first = ox0 as isize + dx;
                        let lo = (-first).clamp(0, run as isize) as usize;
                        let hi = (g.w as isize - first).clamp(lo as isize, run as isize) as usize;
                        row[at..at + lo].fill(T::default());
                        if lo < hi {
                            let from = row_start + (first + lo as isize) as usize;
                            copy_run(row, at + lo, plane, from, hi - lo);
                        }
                        row[at + hi..at + run].fill(T::default());
                        continue;
                    }
                    let out = &mut row[at..at + run];
                    let src = &plane[row_start..][..g.w];
                    // Strided taps: the outputs whose tap lies in the row,
                    // `lo..hi`, copied without testing each one's column.
                    let stride = g.win.stride[1];
                    let first = (ox0 * stride) as isize + dx;
                    let lo = ((-first).max(0) as usize).div_ceil(stride).min(run);
                    let hi = ((g.w as isize - first).max(0) as usize)
                        .div_ceil(stride)
                        .clamp(lo, run);
                    out[..lo].fill(T::default());
                    out[hi..].fill(T::default());
                    if lo < hi {
                        let start = (first + (lo * stride) as isize) as usize;
                        let taps = &src[start..][..(hi - lo - 1) * stride + 1];
                        copy_strided(&mut out[lo..hi], taps, stride);
                    }
                }
            }
        }
    }
}

/// The pixels of `pixels` (output pixels in row-major order, rows of
/// `ow`) as runs along output rows: `(oy, first ox, offset in pixels,
/// length)`. One division for the first run, none after: a division per
/// run showed as 5 % of im2col's samples on small images (a 14 × 14
/// output is runs of 14 values).
fn row_runs(
    pixels: std::ops::Range<usize>,
    ow: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    let width = pixels.len();
    let ow = ow.max(1);
    let (mut oy, mut ox0, mut at) = (pixels.start / ow, pixels.start % ow, 0);
    std::iter::from_fn(move || {
        (at < width).then(|| {
            let run = (ow - ox0).min(width - at);
            let this = (oy, ox0, at, run);
            (oy, ox0, at) = (oy + 1, 0, at + run);
            this
        })
    })
}

/// Copies `len` values from `src[from..]` to `dst[at..]` in fixed groups
/// of 16, which compile to vector moves rather than a `memcpy` call: the
/// runs im2col copies are one output row of a block, 7 to 56 values in
/// most layers, and the calls were most of DenseNet's im2col time. The last
/// group may write past `at + len`, never past `dst`'s end: im2col writes
/// a patch row from left to right, so whatever follows is written again.
#[inline(always)]
fn copy_run<T: Copy>(dst: &mut [T], at: usize, src: &[T], from: usize, len: usize) {
    const GROUP: usize = 16;
    let mut done = 0;
    while done < len {
        let (d, s) = (at + done, from + done);
        if d + GROUP > dst.len() || s + GROUP > src.len() {
            dst[d..at + len].copy_from_slice(&src[s..from + len]);
            return;
        }
        let group: &[T; GROUP] = src[s..s + GROUP].try_into().expect("a group");
        let out: &mut [T; GROUP] = (&mut dst[d..d + GROUP]).try_into().expect("a group");
        *out = *group;
        done += GROUP;
    }
}

/// `out[i] = src[i · stride]`, where `src` holds
/// `(out.len() − 1) · stride + 1` values. Strides 2 and 4 (ResNet's strided 1×1 and 7×7 layers,
/// AlexNet's first) take every `S`-th value of fixed-size groups, which
/// the compiler turns into vector shuffles; an iterator's `step_by` moved
/// one value at a time and was most of ResNet-50's im2col time.
#[inline]
fn copy_strided<T: Copy>(out: &mut [T], src: &[T], stride: usize) {
    fn every<T: Copy, const S: usize>(out: &mut [T], src: &[T]) {
        let Some((last, head)) = out.split_last_mut() else {
            return;
        };
        take_every::<T, S>(head, src, 0);
        *last = src[head.len() * S];
    }
    match stride {
        2 => every::<T, 2>(out, src),
        4 => every::<T, 4>(out, src),
        _ => {
            for (v, &x) in out.iter_mut().zip(src.iter().step_by(stride)) {
                *v = x;
            }
        }
    }
}

/// `dst[i] = src[i · S + j]` for every whole group of `S` in `src`: a loop
/// over fixed-size groups, which the compiler turns into vector shuffles.
#[inline(always)]
fn take_every<T: Copy, const S: usize>(dst: &mut [T], src: &[T], j: usize) {
    for (d, group) in dst.iter_mut().zip(src.chunks_exact(S)) {
        *d = group[j];
    }
}

/// Output pixels per block of a convolution's im2col product: enough that
/// the block's columns (`patch` rows of it) stay in a core's L2 cache
/// while the product reads them, a multiple of 64 for whole vector tiles,
/// and a function of the shape alone, so that the product's bits do not
/// depend on the thread count.
fn pixel_block(patch: usize, pixels: usize) -> usize {
    const COLUMN_BYTES: usize = 256 << 10;
    let fit = COLUMN_BYTES / (4 * patch.max(1));
    fit.next_multiple_of(64).clamp(64, 1024).min(pixels.max(1))
}

/// One output channel of a depthwise convolution (each group reads one
/// input channel): `out = Σ w[ki, kj] · x[oy·s + ki·d - p, ox·s + kj·d - p]`
/// with the taps added in (ki, kj) order from zero, and the padding read
/// as zeros (so an infinite or NaN weight over the padding gives NaN, as
/// in the im2col product).
///
/// It reads the input plane from `padded` ([`PaddedPlane`]), bordered
/// with the padding's zeros and split into column phases, so that every
/// tap reads a contiguous run without a bounds test. Then each output
/// row is computed [`PLANE_LANES`] pixels at a time, every tap added
/// into an array of accumulators that stays in vector registers: the
/// output is written once, and the taps' loop has a fixed length to
/// vectorize, the row's last group included (its extra lanes are dropped).
///
/// A depthwise layer as im2col products is one product per channel with a
/// single filter row: hundreds of tiny products per image, each with its
/// own column buffer, run one after another (ShuffleNet spent most of its
/// time there).
#[inline(always)]
fn depthwise_plane<T>(padded: &PaddedPlane<T>, w: &[T], g: &ConvGeometry, out: &mut [T])
where
    T: Element + std::ops::Add<Output = T> + std::ops::Mul<Output = T>,
{
    const LANES: usize = PLANE_LANES;
    let win = &g.win;
    let (kh, kw) = (win.kernel[0], win.kernel[1]);
    let zero = T::default();
    let columns = padded.tap_columns(kw, win.dilation[1]);
    for (oy, row) in out.chunks_exact_mut(g.ow).enumerate() {
        for first in (0..g.ow).step_by(LANES) {
            let width = LANES.min(g.ow - first);
            let mut acc = [zero; LANES];
            for ki in 0..kh {
                let y = oy * win.stride[0] + ki * win.dilation[0];
                for (&tap, &column) in w[ki * kw..][..kw].iter().zip(&columns) {
                    let taps = padded.taps::<LANES>(y, first, column);
                    for (a, &x) in acc.iter_mut().zip(taps) {
                        *a = *a + tap * x;
                    }
                }
            }
            row[first..first + width].copy_from_slice(&acc[..width]);
        }
    }
}

/// One input channel of a depthwise convolution: `plane` padded into
/// `padded`, then one [`depthwise_plane`] per filter of `filters` (each
/// `kh·kw` weights) into the output planes of `out`.
#[inline(always)]
fn depthwise_channel<T>(
    padded: &mut PaddedPlane<T>,
    plane: &[T],
    filters: &[T],
    g: &ConvGeometry,
    out: &mut [T],
) where
    T: Element + std::ops::Add<Output = T> + std::ops::Mul<Output = T>,
{
    padded.fill(plane, (g.h, g.w), g.win, T::default());
    let taps = g.win.kernel[0] * g.win.kernel[1];
    for (filter, plane) in filters
        .chunks_exact(taps)
        .zip(out.chunks_exact_mut(g.oh * g.ow))
    {
        depthwise_plane(padded, filter, g, plane);
    }
}

multiversioned_plane! {
    /// [`depthwise_channel`] with its loops compiled for `level`.
    fn depthwise_channel_on<T: [Element + std::ops::Add<Output = T> + std::ops::Mul<Output = T>]>(
        padded: &mut PaddedPlane<T>,
        plane: &[T],
        filters: &[T],
        g: &ConvGeometry,
        out: &mut [T]
    ) => depthwise_channel
}

/// A padded plane's layout: plane size, padding, column stride and
/// padding value.
type PlaneLayout<T> = ((usize, usize), [usize; 2], usize, T);

/// One input plane as the window loops read it: bordered by the window's
/// padding and split into column phases by the column stride `s`. Phase
/// `q` of a row holds the padded row's columns `q, q + s, q + 2s, …`, so
/// the tap at column offset `t` of the outputs `ox .. ox + n` is the
/// contiguous run `ox + t / s ..` of phase `t % s`: a vector load, not a
/// gather, at every stride. Each phase has [`PLANE_LANES`] values of slack
/// after it: a row's last outputs are computed as a whole group of lanes
/// too, reading past the phase's end for lanes that are then dropped.
#[derive(Default)]
struct PaddedPlane<T> {
    values: Vec<T>,
    /// Values from one padded row to the next.
    row: usize,
    /// Values from one phase of a row to the next.
    phase: usize,
    /// The column stride, the number of phases.
    stride: usize,
    /// The plane size, padding, column stride and padding value the
    /// border was last filled for: the next plane of the same layout
    /// overwrites the same interior positions and leaves the border as it
    /// is.
    filled_for: Option<PlaneLayout<T>>,
}

impl<T: Element> PaddedPlane<T> {
    /// Fills the plane from `plane` (`h × w` values), bordered by `win`'s
    /// padding filled with `fill`; the buffer is kept for the next plane.
    #[inline(always)]
    fn fill(&mut self, plane: &[T], (h, w): (usize, usize), win: Window2d, fill: T) {
        let [py, px] = win.padding;
        let stride = win.stride[1].max(1);
        let wide = w + 2 * px;
        let layout = ((h, w), [py, px], stride, fill);
        if self.filled_for != Some(layout) {
            self.stride = stride;
            self.phase = wide.div_ceil(stride) + PLANE_LANES;
            self.row = stride * self.phase;
            self.values.clear();
            self.values.resize((h + 2 * py) * self.row, fill);
            self.filled_for = Some(layout);
        }
        if w == 0 {
            // Rows of no values: the plane is all padding.
            return;
        }
        for (y, src) in plane.chunks_exact(w).enumerate() {
            let dst = &mut self.values[(y + py) * self.row..][..self.row];
            match stride {
                1 => dst[px..px + w].copy_from_slice(src),
                2 => split_row::<T, 2>(src, dst, self.phase, px),
                3 => split_row::<T, 3>(src, dst, self.phase, px),
                _ => {
                    for (x, &v) in src.iter().enumerate() {
                        let column = x + px;
                        dst[(column % stride) * self.phase + column / stride] = v;
                    }
                }
            }
        }
    }

    /// Where the taps at column offset `offset` start within a padded
    /// row: phase `offset % s`, shifted by `offset / s`. Computed once per
    /// plane and offset, not per tap (a division each).
    fn tap_column(&self, offset: usize) -> usize {
        (offset % self.stride) * self.phase + offset / self.stride
    }

    /// The window's tap columns ([`Self::tap_column`]) for offsets
    /// `0, step, 2·step, …` (`count` of them).
    fn tap_columns(&self, count: usize, step: usize) -> SmallVec<[usize; 16]> {
        (0..count).map(|k| self.tap_column(k * step)).collect()
    }

    /// The padded values at row `y`, columns `first·s + offset + i·s` for
    /// `i < N`, where `column` is `offset`'s [`Self::tap_column`] (see the
    /// type's description).
    #[inline(always)]
    fn taps<const N: usize>(&self, y: usize, first: usize, column: usize) -> &[T; N] {
        let start = y * self.row + column + first;
        self.values[start..start + N]
            .try_into()
            .expect("a run of N values")
    }
}

/// One input row into the `S` phases of a padded row (`phase` values
/// apart), its first value at padded column `px`: the row in groups of
/// `S`, value `j` of each group going to the same phase, so that each
/// phase is written by a loop the compiler turns into vector shuffles.
#[inline(always)]
fn split_row<T: Copy, const S: usize>(src: &[T], dst: &mut [T], phase: usize, px: usize) {
    let whole = src.len() / S;
    let rest = &src[whole * S..];
    for j in 0..S {
        let column = px + j;
        let start = (column % S) * phase + column / S;
        take_every::<T, S>(&mut dst[start..start + whole], src, j);
    }
    for (j, &v) in rest.iter().enumerate() {
        let column = px + whole * S + j;
        dst[(column % S) * phase + column / S] = v;
    }
}

/// Output channels per input channel up to which a convolution with one
/// input channel per group runs as [`depthwise_plane`]s. With more (a
/// first layer over a grey image: 1 channel in, 32 out) the im2col product
/// has enough filter rows to run at the GEMM's vector speed.
const DEPTHWISE_MAX_MULTIPLIER: usize = 4;

/// Output pixels a plane loop (depthwise convolution, pooling) computes at
/// once: a whole 512-bit vector of f32, or four 128-bit ones. It is also
/// each [`PaddedPlane`] phase's slack.
const PLANE_LANES: usize = 16;

fn conv2d_typed<T>(
    x: &DenseHostTensor,
    w: &DenseHostTensor,
    meta: &TensorMetadata,
    win: Window2d,
    groups: usize,
) -> Result<DenseHostTensor>
where
    T: GemmElement + Send + Sync + std::ops::Add<Output = T> + std::ops::Mul<Output = T>,
{
    let xs = x.shape();
    let g = ConvGeometry {
        n: xs[0],
        c: xs[1],
        h: xs[2],
        w: xs[3],
        o: w.shape()[0],
        oh: meta.shape[2],
        ow: meta.shape[3],
        groups,
        win,
    };
    // Every output value is written by a product below.
    let mut out = DenseHostTensor::for_overwrite(meta.clone())?;
    let (xv, wv) = (x.as_slice::<T>()?, w.as_slice::<T>()?);
    let pixels = g.oh * g.ow;
    let (cg, og) = (g.c / groups, g.o / groups);
    let patch = cg * win.kernel[0] * win.kernel[1];
    let image_out = g.o * pixels;
    if image_out == 0 || g.n == 0 {
        return Ok(out);
    }
    if patch == 0 {
        out.as_mut_slice::<T>()?.fill(T::default());
        return Ok(out);
    }
    if cg == 1 && og <= DEPTHWISE_MAX_MULTIPLIER {
        // Depthwise: each output channel is its own small job, whatever
        // the thread count, so the bits do not depend on it.
        // A job is one input channel (padded once) and its `og` outputs.
        let (plane_in, patch_w) = (g.h * g.w, win.kernel[0] * win.kernel[1]);
        let level = crate::isa::level();
        let channel = |padded: &mut PaddedPlane<T>, index: usize, planes: &mut [T]| {
            // `index` counts (image, group) pairs, which are the input's planes.
            let plane = &xv[index * plane_in..][..plane_in];
            let filters = &wv[(index % groups) * og * patch_w..][..og * patch_w];
            depthwise_channel_on(level, padded, plane, filters, &g, planes);
        };
        let y = out.as_mut_slice::<T>()?;
        if g.n * image_out * patch >= crate::PARALLEL_THRESHOLD {
            crate::pool::for_each_chunk_init(y, og * pixels, PaddedPlane::default, channel);
        } else {
            let mut padded = PaddedPlane::default();
            for (index, planes) in y.chunks_mut(og * pixels).enumerate() {
                channel(&mut padded, index, planes);
            }
        }
        return Ok(out);
    }
    // A 1×1 window with unit stride and no padding reads each pixel once
    // in place: the image's channel planes are its im2col matrix.
    let pointwise = win.kernel == [1, 1] && win.stride == [1, 1] && win.padding == [0, 0];
    let block = pixel_block(patch, pixels);
    let y = out.as_mut_slice::<T>()?;
    let images_in_parallel = g.n > 1 && g.n * image_out * patch >= crate::PARALLEL_THRESHOLD;
    // `cols`: a thread's im2col scratch, kept across its images.
    let per_image = |cols: &mut Vec<T>, image: usize, y: &mut [T], parallel: bool| {
        let x_img = &xv[image * g.c * g.h * g.w..][..g.c * g.h * g.w];
        for group in 0..groups {
            let w_g = &wv[group * og * patch..][..og * patch];
            let y_g = &mut y[group * og * pixels..][..og * pixels];
            if pointwise {
                let x_g = &x_img[group * cg * pixels..][..cg * pixels];
                gemm_into(og, pixels, cg, w_g, x_g, y_g, parallel);
            } else {
                let shape = (patch, block);
                conv_blocks(x_img, &g, group, w_g, y_g, shape, cols, parallel);
            }
        }
    };
    if images_in_parallel {
        crate::pool::for_each_chunk_init(y, image_out, Vec::new, |cols, i, image| {
            per_image(cols, i, image, false)
        });
    } else {
        let mut cols = Vec::new();
        for (i, image) in y.chunks_mut(image_out).enumerate() {
            per_image(&mut cols, i, image, true);
        }
    }
    Ok(out)
}

/// One image and channel group of a convolution, `block` output pixels at
/// a time: the block's im2col columns, their product with the group's
/// filters, and the result copied into the block's columns of `y_g`
/// (`og` rows of all pixels). Blocks run in parallel when `parallel`.
/// `scratch` holds the columns of a whole-image block, kept by the caller
/// across images rather than allocated and zeroed for each (157 KB per
/// image in the CLI's CNN).
#[allow(clippy::too_many_arguments)]
fn conv_blocks<T: GemmElement + Send + Sync>(
    x_img: &[T],
    g: &ConvGeometry,
    group: usize,
    w_g: &[T],
    y_g: &mut [T],
    (patch, block): (usize, usize),
    scratch: &mut Vec<T>,
    parallel: bool,
) {
    let pixels = g.oh * g.ow;
    let og = y_g.len() / pixels;
    let blocks = pixels.div_ceil(block);
    if blocks == 1 {
        // One block is the whole image: the product goes straight into
        // `y_g`, split across threads by the GEMM itself (the same shape,
        // so the same bits, as the block path would give). im2col writes
        // every column value, so the scratch needs no clearing.
        scratch.resize(patch * pixels, T::default());
        let cols = &mut scratch[..patch * pixels];
        im2col_columns(x_img, g, group, 0..pixels, cols);
        gemm_into(og, pixels, patch, w_g, cols, y_g, parallel);
        return;
    }
    // Each block's piece of every output row, as disjoint slices.
    let mut pieces: Vec<Vec<&mut [T]>> = (0..blocks).map(|_| Vec::with_capacity(og)).collect();
    for row in y_g.chunks_mut(pixels) {
        for (b, piece) in row.chunks_mut(block).enumerate() {
            pieces[b].push(piece);
        }
    }
    let run = |(cols, product): &mut (Vec<T>, Vec<T>), b: usize, rows: Vec<&mut [T]>| {
        let first = b * block;
        let width = block.min(pixels - first);
        let cols = &mut cols[..patch * width];
        im2col_columns(x_img, g, group, first..first + width, cols);
        let product = &mut product[..og * width];
        gemm_into(og, width, patch, w_g, cols, product, false);
        for (row, values) in rows.into_iter().zip(product.chunks_exact(width)) {
            row.copy_from_slice(values);
        }
    };
    let buffers = || {
        (
            vec![T::default(); patch * block],
            vec![T::default(); og * block],
        )
    };
    let jobs = pieces.into_iter().enumerate();
    if !parallel {
        let mut state = buffers();
        for (b, rows) in jobs {
            run(&mut state, b, rows);
        }
        return;
    }
    crate::pool::for_each_item_init(jobs, blocks, buffers, |state, (b, rows)| {
        run(state, b, rows)
    });
}

/// The window of a convolution whose filter is `w`. Its size is read from
/// the filter at run time, not when the kernel is made: a cached kernel
/// serves every shape with the same attributes and dtypes, so a window
/// sized at instantiation would be applied to the next filter of another
/// size.
fn filter_window(win: Window2d, w: &DenseHostTensor) -> Window2d {
    let dims = w.shape().dims();
    Window2d {
        kernel: [dims[2], dims[3]],
        ..win
    }
}

fn conv2d_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    // The kernel size is a placeholder: see `filter_window`.
    let strides = conv2d_window(attrs, [1, 1])?;
    let groups = attrs.int("groups")? as usize;
    let dtype = inputs[0].dtype;
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            let (x, w, meta) = (&inputs[0], &inputs[1], &ctx.outputs[0]);
            let win = filter_window(strides, w);
            let out = match dtype {
                DType::F32 => conv2d_typed::<f32>(x, w, meta, win, groups)?,
                DType::F64 => conv2d_typed::<f64>(x, w, meta, win, groups)?,
                _ => via_f32(&[x, w], meta, |t, m| {
                    conv2d_typed::<f32>(t[0], t[1], m, win, groups)
                })?,
            };
            Ok(smallvec![out])
        },
    ))
}

/// The in-bounds input range `[start, end)` of output position `o` along
/// spatial `axis` (of size `size`): padding taps fall outside it.
fn window_span(o: usize, axis: usize, size: usize, win: Window2d) -> (usize, usize) {
    let start = (o * win.stride[axis]) as isize - win.padding[axis] as isize;
    let end = (start + win.kernel[axis] as isize).min(size as isize);
    (start.max(0) as usize, end.max(0) as usize)
}

/// Pools every (image, channel) plane of `x` into `meta`'s shape with
/// `plane_job(padded buffer, input plane, output plane)`, planes in
/// parallel when the work is large enough.
fn pool_planes<T: Element + Send + Sync>(
    x: &DenseHostTensor,
    meta: &TensorMetadata,
    win: Window2d,
    plane_job: impl Fn(&mut PaddedPlane<T>, &[T], &mut [T]) + Sync,
) -> Result<DenseHostTensor> {
    let (h, w) = (x.shape()[2], x.shape()[3]);
    let (oh, ow) = (meta.shape[2], meta.shape[3]);
    let mut out = DenseHostTensor::for_overwrite(meta.clone())?;
    let xv = x.as_slice::<T>()?;
    if oh * ow == 0 {
        return Ok(out);
    }
    let job = |padded: &mut PaddedPlane<T>, p: usize, y: &mut [T]| {
        plane_job(padded, &xv[p * h * w..][..h * w], y)
    };
    let y = out.as_mut_slice::<T>()?;
    if y.len() * win.kernel[0] * win.kernel[1] >= crate::PARALLEL_THRESHOLD {
        crate::pool::for_each_chunk_init(y, oh * ow, PaddedPlane::default, job);
    } else {
        let mut padded = PaddedPlane::default();
        for (p, plane) in y.chunks_mut(oh * ow).enumerate() {
            job(&mut padded, p, plane);
        }
    }
    Ok(out)
}

fn max_pool_typed<T: Element + Send + Sync + num_like::Float>(
    x: &DenseHostTensor,
    meta: &TensorMetadata,
    win: Window2d,
) -> Result<DenseHostTensor> {
    let (dims, ow) = ((x.shape()[2], x.shape()[3]), meta.shape[3]);
    let level = crate::isa::level();
    pool_planes::<T>(x, meta, win, |padded, plane, y| {
        max_pool_plane_on(level, padded, plane, dims, win, ow, y)
    })
}

multiversioned_plane! {
    /// [`max_pool_plane`] with its loops compiled for `level`.
    fn max_pool_plane_on<T: [Element + num_like::Float]>(
        padded: &mut PaddedPlane<T>,
        plane: &[T],
        dims: (usize, usize),
        win: Window2d,
        ow: usize,
        out: &mut [T]
    ) => max_pool_plane
}

/// One plane of a max pooling: `plane` (`dims` values) padded into
/// `padded`, bordered with `-inf` (which never wins), then pooled into
/// `out` by [`fold_windows`].
///
/// NaN wins, as in the Max reduction: once the running maximum is NaN no
/// comparison replaces it.
#[inline(always)]
fn max_pool_plane<T: Element + num_like::Float>(
    padded: &mut PaddedPlane<T>,
    plane: &[T],
    dims: (usize, usize),
    win: Window2d,
    ow: usize,
    out: &mut [T],
) {
    padded.fill(plane, dims, win, T::NEG_INF);
    let step = |m: T, v: T| if v.is_nan() || v > m { v } else { m };
    fold_windows(padded, win, out, ow, T::NEG_INF, step, |m, _, _| m);
}

/// Every pooling window of a padded plane folded into `out` (`ow` values
/// a row): each output is `finish(acc, oy, ox)` of its window's taps
/// folded into `acc` from `init` in row-major order, the padding's
/// included. Each output row is computed [`PLANE_LANES`] pixels at a time
/// in an array of accumulators that stays in vector registers, every tap
/// read without a bounds test.
#[inline(always)]
fn fold_windows<T: Element, A: Copy>(
    padded: &PaddedPlane<T>,
    win: Window2d,
    out: &mut [T],
    ow: usize,
    init: A,
    step: impl Fn(A, T) -> A,
    finish: impl Fn(A, usize, usize) -> T,
) {
    const LANES: usize = PLANE_LANES;
    let (kh, kw) = (win.kernel[0], win.kernel[1]);
    let columns = padded.tap_columns(kw, 1);
    for (oy, row) in out.chunks_exact_mut(ow).enumerate() {
        for first in (0..ow).step_by(LANES) {
            let width = LANES.min(ow - first);
            let mut acc = [init; LANES];
            for ki in 0..kh {
                // The shape rule sized the output so that every tap of
                // every output pixel lies inside the padded plane.
                let y = oy * win.stride[0] + ki;
                for &column in &columns {
                    let taps = padded.taps::<LANES>(y, first, column);
                    for (a, &v) in acc.iter_mut().zip(taps) {
                        *a = step(*a, v);
                    }
                }
            }
            for (i, (out, &a)) in row[first..first + width].iter_mut().zip(&acc).enumerate() {
                *out = finish(a, oy, first + i);
            }
        }
    }
}

fn avg_pool_typed<T: Element + Send + Sync + num_like::Float>(
    x: &DenseHostTensor,
    meta: &TensorMetadata,
    win: Window2d,
    include_pad: bool,
) -> Result<DenseHostTensor> {
    let (dims, ow) = ((x.shape()[2], x.shape()[3]), meta.shape[3]);
    let level = crate::isa::level();
    pool_planes::<T>(x, meta, win, |padded, plane, y| {
        avg_pool_plane_on(level, padded, plane, dims, (win, include_pad), ow, y)
    })
}

multiversioned_plane! {
    /// [`avg_pool_plane`] with its loops compiled for `level`.
    fn avg_pool_plane_on<T: [Element + num_like::Float]>(
        padded: &mut PaddedPlane<T>,
        plane: &[T],
        dims: (usize, usize),
        window: (Window2d, bool),
        ow: usize,
        out: &mut [T]
    ) => avg_pool_plane
}

/// One plane of an average pooling, as [`max_pool_plane`] with zeros for
/// padding: each window's taps summed in f64 in row-major order (the
/// padding's zeros change no sum), divided by the whole window when
/// `include_pad`, else by its in-bounds taps, and rounded once.
#[inline(always)]
fn avg_pool_plane<T: Element + num_like::Float>(
    padded: &mut PaddedPlane<T>,
    plane: &[T],
    (h, w): (usize, usize),
    (win, include_pad): (Window2d, bool),
    ow: usize,
    out: &mut [T],
) {
    padded.fill(plane, (h, w), win, T::default());
    let step = |sum: f64, v: T| sum + num_like::Float::to_f64(v);
    let finish = |sum: f64, oy: usize, ox: usize| {
        // Windows never pass the padded edge (no ceil mode), so counting
        // padding means dividing by the whole window.
        let divisor = if include_pad {
            win.kernel[0] * win.kernel[1]
        } else {
            let (ys, ye) = window_span(oy, 0, h, win);
            let (xs, xe) = window_span(ox, 1, w, win);
            (ye.saturating_sub(ys) * xe.saturating_sub(xs)).max(1)
        };
        T::from_f64(sum / divisor as f64)
    };
    fold_windows(padded, win, out, ow, 0.0, step, finish);
}

/// The few float operations pooling needs, for f32 and f64.
mod num_like {
    pub trait Float: Copy + PartialOrd {
        const NEG_INF: Self;
        fn is_nan(self) -> bool;
        fn from_f64(v: f64) -> Self;
        fn to_f64(self) -> f64;
    }
    impl Float for f32 {
        const NEG_INF: f32 = f32::NEG_INFINITY;
        fn is_nan(self) -> bool {
            f32::is_nan(self)
        }
        fn from_f64(v: f64) -> f32 {
            v as f32
        }
        #[inline(always)]
        fn to_f64(self) -> f64 {
            self as f64
        }
    }
    impl Float for f64 {
        const NEG_INF: f64 = f64::NEG_INFINITY;
        fn is_nan(self) -> bool {
            f64::is_nan(self)
        }
        fn from_f64(v: f64) -> f64 {
            v
        }
        #[inline(always)]
        fn to_f64(self) -> f64 {
            self
        }
    }
}

fn max_pool_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let win = pool_window(attrs)?;
    let dtype = inputs[0].dtype;
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            let (x, meta) = (&inputs[0], &ctx.outputs[0]);
            Ok(smallvec![match dtype {
                DType::F32 => max_pool_typed::<f32>(x, meta, win)?,
                DType::F64 => max_pool_typed::<f64>(x, meta, win)?,
                _ => via_f32(&[x], meta, |t, m| max_pool_typed::<f32>(t[0], m, win))?,
            }])
        },
    ))
}

fn avg_pool_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let win = pool_window(attrs)?;
    let include_pad = attrs.bool("count_include_pad")?;
    let dtype = inputs[0].dtype;
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            let (x, meta) = (&inputs[0], &ctx.outputs[0]);
            Ok(smallvec![match dtype {
                DType::F32 => avg_pool_typed::<f32>(x, meta, win, include_pad)?,
                DType::F64 => avg_pool_typed::<f64>(x, meta, win, include_pad)?,
                _ => via_f32(&[x], meta, |t, m| avg_pool_typed::<f32>(
                    t[0],
                    m,
                    win,
                    include_pad
                ))?,
            }])
        },
    ))
}

// ---------------------------------------------------------------------------
// Backward kernels.

/// Adds the im2col matrix `cols` of one image and channel group back into
/// the image (the adjoint of [`im2col`]: overlapping taps accumulate).
fn col2im<T: Element + std::ops::AddAssign>(
    cols: &[T],
    g: &ConvGeometry,
    group: usize,
    x: &mut [T],
) {
    let cg = g.c / g.groups;
    let (kh, kw) = (g.win.kernel[0], g.win.kernel[1]);
    let pixels = g.oh * g.ow;
    for ci in 0..cg {
        let plane = &mut x[(group * cg + ci) * g.h * g.w..][..g.h * g.w];
        for ki in 0..kh {
            for kj in 0..kw {
                let row = &cols[((ci * kh + ki) * kw + kj) * pixels..][..pixels];
                // The outputs `lo..hi` of each row tap a column inside the
                // image (`ix = ox · stride + dx`); the rest tap padding.
                // Worked out once per tap instead of tested per value, the
                // in-image part is a plain loop (a vector one for stride 1).
                let stride = g.win.stride[1];
                let dx = (kj * g.win.dilation[1]) as isize - g.win.padding[1] as isize;
                let lo = ((-dx).max(0) as usize).div_ceil(stride).min(g.ow);
                let hi = ((g.w as isize - dx).max(0) as usize)
                    .div_ceil(stride)
                    .clamp(lo, g.ow);
                if lo == hi {
                    continue;
                }
                let first = (dx + (lo * stride) as isize) as usize;
                for oy in 0..g.oh {
                    let iy = (oy * g.win.stride[0] + ki * g.win.dilation[0]) as isize
                        - g.win.padding[0] as isize;
                    if iy < 0 || iy >= g.h as isize {
                        continue;
                    }
                    let dst = &mut plane[iy as usize * g.w..][..g.w];
                    let src = &row[oy * g.ow..][lo..hi];
                    if stride == 1 {
                        for (d, v) in dst[first..first + src.len()].iter_mut().zip(src) {
                            *d += *v;
                        }
                    } else {
                        let taps = dst[first..].iter_mut().step_by(stride);
                        for (d, v) in taps.zip(src) {
                            *d += *v;
                        }
                    }
                }
            }
        }
    }
}

fn transposed<T: Copy + Default>(m: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut t = vec![T::default(); m.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = m[r * cols + c];
        }
    }
    t
}

fn geometry(
    x_shape: &[usize],
    w_shape: &[usize],
    g_shape: &[usize],
    win: Window2d,
    groups: usize,
) -> ConvGeometry {
    ConvGeometry {
        n: x_shape[0],
        c: x_shape[1],
        h: x_shape[2],
        w: x_shape[3],
        o: w_shape[0],
        oh: g_shape[2],
        ow: g_shape[3],
        groups,
        win,
    }
}

/// dx = col2im(wᵀ g), image by image and group by group.
fn backprop_input_typed<T: GemmElement + Send + Sync + std::ops::AddAssign>(
    gt: &DenseHostTensor,
    w: &DenseHostTensor,
    meta: &TensorMetadata,
    win: Window2d,
    groups: usize,
) -> Result<DenseHostTensor> {
    let g = geometry(
        meta.shape.dims(),
        w.shape().dims(),
        gt.shape().dims(),
        win,
        groups,
    );
    let mut out = DenseHostTensor::zeros(meta.clone())?;
    let (gv, wv) = (gt.as_slice::<T>()?, w.as_slice::<T>()?);
    let pixels = g.oh * g.ow;
    let (cg, og) = (g.c / groups, g.o / groups);
    let patch = cg * win.kernel[0] * win.kernel[1];
    let image_in = g.c * g.h * g.w;
    if image_in == 0 || pixels == 0 || og == 0 {
        return Ok(out);
    }
    let w_t: Vec<Vec<T>> = (0..groups)
        .map(|group| transposed(&wv[group * og * patch..][..og * patch], og, patch))
        .collect();
    // `cols` is scratch, one per thread: the product overwrites it whole.
    let per_image = |cols: &mut Vec<T>, image: usize, dx: &mut [T]| {
        let g_img = &gv[image * g.o * pixels..][..g.o * pixels];
        for group in 0..groups {
            let g_g = &g_img[group * og * pixels..][..og * pixels];
            gemm_into(patch, pixels, og, &w_t[group], g_g, cols, false);
            col2im(cols, &g, group, dx);
        }
    };
    let scratch = || vec![T::default(); patch * pixels];
    let dx = out.as_mut_slice::<T>()?;
    if g.n > 1 && g.n * image_in * og >= crate::PARALLEL_THRESHOLD {
        crate::pool::for_each_chunk_init(dx, image_in, scratch, per_image);
    } else {
        let mut cols = scratch();
        for (i, image) in dx.chunks_mut(image_in).enumerate() {
            per_image(&mut cols, i, image);
        }
    }
    Ok(out)
}

/// dw = Σ over images of g im2col(x)ᵀ, group by group.
///
/// The images are summed in runs of consecutive images, each run into a
/// partial dw of its own, on as many threads as there are runs; the
/// partials are then added in run order. The runs depend on the shape
/// alone, so the bits do not depend on the thread count. A single run
/// (one image, or too little work to share) splits each product across
/// threads instead, which only pays for a large filter: the product is
/// `og × patch`, usually too small to cut into bands.
fn backprop_filter_typed<T: GemmElement + Send + Sync + std::ops::AddAssign>(
    x: &DenseHostTensor,
    gt: &DenseHostTensor,
    meta: &TensorMetadata,
    win: Window2d,
    groups: usize,
) -> Result<DenseHostTensor> {
    let g = geometry(
        x.shape().dims(),
        meta.shape.dims(),
        gt.shape().dims(),
        win,
        groups,
    );
    let mut out = DenseHostTensor::zeros(meta.clone())?;
    let (xv, gv) = (x.as_slice::<T>()?, gt.as_slice::<T>()?);
    let pixels = g.oh * g.ow;
    let (cg, og) = (g.c / groups, g.o / groups);
    let patch = cg * win.kernel[0] * win.kernel[1];
    if pixels == 0 || patch == 0 || og == 0 || g.n == 0 {
        return Ok(out);
    }
    let dw = out.as_mut_slice::<T>()?;
    // Adds image `image`'s share into `acc` (the whole filter's gradient),
    // with `cols` and `part` as scratch.
    let add_image = |image: usize, acc: &mut [T], cols: &mut [T], part: &mut [T], parallel| {
        let x_img = &xv[image * g.c * g.h * g.w..][..g.c * g.h * g.w];
        let g_img = &gv[image * g.o * pixels..][..g.o * pixels];
        for group in 0..groups {
            im2col(x_img, &g, group, cols);
            // `cols` is im2col(x) (patch × pixels): read as its transpose.
            T::gemm(
                (og, patch, pixels),
                (&g_img[group * og * pixels..][..og * pixels], Layout::AsIs),
                (cols, Layout::Transposed),
                part,
                parallel,
                &no_epilogue,
            );
            for (d, p) in acc[group * og * patch..][..og * patch]
                .iter_mut()
                .zip(&*part)
            {
                *d += *p;
            }
        }
    };
    let scratch = || {
        (
            vec![T::default(); patch * pixels],
            vec![T::default(); og * patch],
        )
    };
    let runs = filter_gradient_runs(g.n, dw.len(), og * patch * pixels);
    if runs == 1 {
        let (mut cols, mut part) = scratch();
        for image in 0..g.n {
            add_image(image, dw, &mut cols, &mut part, true);
        }
        return Ok(out);
    }
    let per_run = g.n.div_ceil(runs);
    let mut partials = vec![T::default(); g.n.div_ceil(per_run) * dw.len()];
    crate::pool::for_each_chunk_init(
        &mut partials,
        dw.len(),
        scratch,
        |(cols, part), run, acc| {
            for image in run * per_run..((run + 1) * per_run).min(g.n) {
                add_image(image, acc, cols, part, false);
            }
        },
    );
    for partial in partials.chunks_exact(dw.len()) {
        for (d, p) in dw.iter_mut().zip(partial) {
            *d += *p;
        }
    }
    Ok(out)
}

/// How many runs of images a filter gradient sums separately: up to
/// [`MAX_FILTER_GRADIENT_RUNS`], fewer when the partial gradients would
/// take more than 16 Mi values or there is less than
/// [`crate::PARALLEL_THRESHOLD`] multiply-adds of work per run. A
/// function of the shape alone (see [`backprop_filter_typed`]).
fn filter_gradient_runs(images: usize, filter_len: usize, work_per_image: usize) -> usize {
    const PARTIAL_VALUES: usize = 16 << 20;
    let by_memory = PARTIAL_VALUES / filter_len.max(1);
    let by_work = images * work_per_image / crate::PARALLEL_THRESHOLD;
    images
        .min(MAX_FILTER_GRADIENT_RUNS)
        .min(by_memory)
        .min(by_work)
        .max(1)
}

/// Runs enough for 16 cores to share, and for two to balance when one is
/// slowed by a neighbour.
const MAX_FILTER_GRADIENT_RUNS: usize = 16;

fn conv_backprop_window(attrs: &Attrs<'_>, filter: &[usize]) -> Result<(Window2d, usize)> {
    Ok((
        conv2d_window(attrs, [filter[2], filter[3]])?,
        attrs.int("groups")? as usize,
    ))
}

fn backprop_input_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    // The kernel size is a placeholder: see `filter_window`.
    let (strides, groups) = conv_backprop_window(attrs, &[0, 0, 1, 1])?;
    let dtype = inputs[0].dtype;
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            let (g, w, meta) = (&inputs[0], &inputs[1], &ctx.outputs[0]);
            let win = filter_window(strides, w);
            Ok(smallvec![match dtype {
                DType::F32 => backprop_input_typed::<f32>(g, w, meta, win, groups)?,
                DType::F64 => backprop_input_typed::<f64>(g, w, meta, win, groups)?,
                _ => via_f32(&[g, w], meta, |t, m| backprop_input_typed::<f32>(
                    t[0], t[1], m, win, groups
                ))?,
            }])
        },
    ))
}

fn backprop_filter_factory(attrs: &Attrs<'_>, _: &[TensorMetadata]) -> Result<Kernel> {
    let filter = attrs.dims("shape")?;
    let (win, groups) = conv_backprop_window(attrs, &filter)?;
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            let (x, g, meta) = (&inputs[0], &inputs[1], &ctx.outputs[0]);
            Ok(smallvec![match meta.dtype {
                DType::F32 => backprop_filter_typed::<f32>(x, g, meta, win, groups)?,
                DType::F64 => backprop_filter_typed::<f64>(x, g, meta, win, groups)?,
                _ => via_f32(&[x, g], meta, |t, m| backprop_filter_typed::<f32>(
                    t[0], t[1], m, win, groups
                ))?,
            }])
        },
    ))
}

/// Visits every pooling window of every plane: `visit(plane, window taps as
/// flat indices into the plane, output index)`.
fn for_each_window(
    planes: usize,
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
    win: Window2d,
    mut visit: impl FnMut(usize, &mut dyn Iterator<Item = usize>, usize, usize),
) {
    for p in 0..planes {
        for oy in 0..oh {
            let (ys, ye) = window_span(oy, 0, h, win);
            for ox in 0..ow {
                let (xs, xe) = window_span(ox, 1, w, win);
                let count = ye.saturating_sub(ys) * xe.saturating_sub(xs);
                let mut taps = (ys..ye).flat_map(move |iy| (xs..xe).map(move |ix| iy * w + ix));
                visit(p, &mut taps, p * oh * ow + oy * ow + ox, count);
            }
        }
    }
}

fn pool_grad_typed<
    T: Element + num_like::Float + std::ops::AddAssign + std::ops::Div<Output = T>,
>(
    x: &DenseHostTensor,
    gt: &DenseHostTensor,
    win: Window2d,
    mode: Option<bool>,
) -> Result<DenseHostTensor> {
    let xs = x.shape();
    let (h, w) = (xs[2], xs[3]);
    let (oh, ow) = (gt.shape()[2], gt.shape()[3]);
    let mut out = DenseHostTensor::zeros(x.metadata().clone())?;
    let (xv, gv) = (x.as_slice::<T>()?, gt.as_slice::<T>()?);
    let dx = out.as_mut_slice::<T>()?;
    let full = win.kernel[0] * win.kernel[1];
    for_each_window(xs[0] * xs[1], h, w, oh, ow, win, |p, taps, o, count| {
        let base = p * h * w;
        match mode {
            // Max: the first maximum (or first NaN) takes the gradient.
            None => {
                let mut best: Option<(usize, T)> = None;
                for t in taps {
                    let v = xv[base + t];
                    best = match best {
                        None => Some((t, v)),
                        Some((_, b)) if b.is_nan() => best,
                        Some(_) if v.is_nan() => Some((t, v)),
                        Some((_, b)) if v > b => Some((t, v)),
                        keep => keep,
                    };
                }
                if let Some((t, _)) = best {
                    dx[base + t] += gv[o];
                }
            }
            // Average: spread over the divisor the forward op used.
            Some(include_pad) => {
                let divisor = if include_pad { full } else { count.max(1) };
                let share = gv[o] / <T as num_like::Float>::from_f64(divisor as f64);
                for t in taps {
                    dx[base + t] += share;
                }
            }
        }
    });
    Ok(out)
}

fn pool_grad_factory(
    attrs: &Attrs<'_>,
    inputs: &[TensorMetadata],
    mode: Option<bool>,
) -> Result<Kernel> {
    let win = pool_window(attrs)?;
    let dtype = inputs[0].dtype;
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            let (x, g, meta) = (&inputs[0], &inputs[1], &ctx.outputs[0]);
            Ok(smallvec![match dtype {
                DType::F32 => pool_grad_typed::<f32>(x, g, win, mode)?,
                DType::F64 => pool_grad_typed::<f64>(x, g, win, mode)?,
                _ => via_f32(&[x, g], meta, |t, _| pool_grad_typed::<f32>(
                    t[0], t[1], win, mode
                ))?,
            }])
        },
    ))
}

fn max_pool_grad_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    pool_grad_factory(attrs, inputs, None)
}

fn avg_pool_grad_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    pool_grad_factory(attrs, inputs, Some(attrs.bool("count_include_pad")?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::nn as reference;
    use proptest::prelude::*;
    use stagecraft_ops::{OpAttrs, OpDef};

    fn run(
        def: &'static OpDef,
        inputs: &[DenseHostTensor],
        attrs: &OpAttrs,
    ) -> Result<DenseHostTensor> {
        let metas: Vec<TensorMetadata> = inputs.iter().map(|t| t.metadata().clone()).collect();
        let out = def.infer(&metas, attrs)?;
        let k = (crate::registry().get(def).unwrap())(&Attrs::new(attrs, def), &metas)?;
        let mut res = k(
            inputs.iter().cloned().collect(),
            &KernelContext {
                attrs: Attrs::new(attrs, def),
                outputs: &out,
            },
        )?;
        Ok(res.remove(0))
    }

    fn values(n: usize, seed: usize) -> Vec<f64> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104729) % 997) as f64 - 498.0) / 200.0)
            .collect()
    }

    /// An f32 result's values as f64 (exact), to compare with a reference.
    fn widened(t: &DenseHostTensor) -> Vec<f64> {
        t.as_slice::<f32>()
            .unwrap()
            .iter()
            .map(|&v| v as f64)
            .collect()
    }

    fn close(got: &[f64], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!(
                g == w || (g - w).abs() <= tol * (1.0 + w.abs()) || (g.is_nan() && w.is_nan()),
                "{g} vs {w}"
            );
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn check_conv(
        n: usize,
        c: usize,
        h: usize,
        w: usize,
        o: usize,
        k: [usize; 2],
        stride: [usize; 2],
        pad: [usize; 2],
        dil: [usize; 2],
        groups: usize,
    ) {
        let xd = [n, c, h, w];
        let wd = [o, c / groups, k[0], k[1]];
        let (xv, wv) = (
            values(xd.iter().product(), 1),
            values(wd.iter().product(), 2),
        );
        let mut attrs = OpAttrs::new();
        attrs
            .set_dims("stride", &stride)
            .set_dims("padding", &pad)
            .set_dims("dilation", &dil)
            .set_int("groups", groups as i64);
        let want = reference::conv2d(&xv, xd, &wv, wd, stride, pad, dil, groups);
        let got = run(
            &stagecraft_ops::CONV2D,
            &[
                DenseHostTensor::from_slice(&xv, xd).unwrap(),
                DenseHostTensor::from_slice(&wv, wd).unwrap(),
            ],
            &attrs,
        )
        .unwrap();
        close(got.as_slice::<f64>().unwrap(), &want, 1e-12);
        let x32: Vec<f32> = xv.iter().map(|&v| v as f32).collect();
        let w32: Vec<f32> = wv.iter().map(|&v| v as f32).collect();
        let got = run(
            &stagecraft_ops::CONV2D,
            &[
                DenseHostTensor::from_slice(&x32, xd).unwrap(),
                DenseHostTensor::from_slice(&w32, wd).unwrap(),
            ],
            &attrs,
        )
        .unwrap();
        let got = widened(&got);
        close(&got, &want, 1e-4);
    }

    /// dw by its definition: every tap of every window, one at a time.
    #[allow(clippy::too_many_arguments)]
    fn filter_gradient_by_definition(
        x: &[f64],
        [n, c, h, w]: [usize; 4],
        gy: &[f64],
        [o, oh, ow]: [usize; 3],
        k: [usize; 2],
        stride: [usize; 2],
        pad: [usize; 2],
        groups: usize,
    ) -> Vec<f64> {
        let (cg, og) = (c / groups, o / groups);
        let mut dw = vec![0.0; o * cg * k[0] * k[1]];
        for img in 0..n {
            for oc in 0..o {
                let group = oc / og;
                for ci in 0..cg {
                    for ki in 0..k[0] {
                        for kj in 0..k[1] {
                            let mut sum = 0.0;
                            for oy in 0..oh {
                                for ox in 0..ow {
                                    let iy = (oy * stride[0] + ki) as isize - pad[0] as isize;
                                    let ix = (ox * stride[1] + kj) as isize - pad[1] as isize;
                                    if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                        continue;
                                    }
                                    let xi = ((img * c + group * cg + ci) * h + iy as usize) * w
                                        + ix as usize;
                                    sum += gy[((img * o + oc) * oh + oy) * ow + ox] * x[xi];
                                }
                            }
                            dw[((oc * cg + ci) * k[0] + ki) * k[1] + kj] += sum;
                        }
                    }
                }
            }
        }
        dw
    }

    /// The filter gradient against its definition, in f64 and f32, and
    /// the same bits on one thread as on two.
    #[allow(clippy::too_many_arguments)]
    fn check_filter_gradient(
        n: usize,
        c: usize,
        h: usize,
        w: usize,
        o: usize,
        k: [usize; 2],
        stride: [usize; 2],
        pad: [usize; 2],
        groups: usize,
    ) {
        let oh = (h + 2 * pad[0] - k[0]) / stride[0] + 1;
        let ow = (w + 2 * pad[1] - k[1]) / stride[1] + 1;
        let (xd, gd, wd) = ([n, c, h, w], [n, o, oh, ow], [o, c / groups, k[0], k[1]]);
        let xv = values(xd.iter().product(), 3);
        let gv = values(gd.iter().product(), 4);
        let want = filter_gradient_by_definition(&xv, xd, &gv, [o, oh, ow], k, stride, pad, groups);
        let mut attrs = OpAttrs::new();
        attrs
            .set_dims("stride", &stride)
            .set_dims("padding", &pad)
            .set_dims("dilation", &[1, 1])
            .set_int("groups", groups as i64)
            .set_dims("shape", &wd);
        let grad = |x: DenseHostTensor, g: DenseHostTensor| {
            run(&stagecraft_ops::CONV2D_BACKPROP_FILTER, &[x, g], &attrs).unwrap()
        };
        let got = grad(
            DenseHostTensor::from_slice(&xv, xd).unwrap(),
            DenseHostTensor::from_slice(&gv, gd).unwrap(),
        );
        close(got.as_slice::<f64>().unwrap(), &want, 1e-12);
        let x32: Vec<f32> = xv.iter().map(|&v| v as f32).collect();
        let g32: Vec<f32> = gv.iter().map(|&v| v as f32).collect();
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                grad(
                    DenseHostTensor::from_slice(&x32, xd).unwrap(),
                    DenseHostTensor::from_slice(&g32, gd).unwrap(),
                )
                .as_slice::<f32>()
                .unwrap()
                .to_vec()
            })
        };
        let (one, two) = (on(1), on(2));
        assert_eq!(
            one, two,
            "the filter gradient's bits depend on the thread count"
        );
        let one: Vec<f64> = one.iter().map(|&v| v as f64).collect();
        close(&one, &want, 1e-4);
    }

    #[test]
    fn filter_gradient_matches_its_definition() {
        // One run: too little work to share.
        assert_eq!(filter_gradient_runs(2, 4 * 2 * 9, 4 * 18 * 36), 1);
        check_filter_gradient(2, 2, 6, 6, 4, [3, 3], [1, 1], [0, 0], 1);
        // Runs of several images, the last one shorter.
        assert_eq!(filter_gradient_runs(11, 8 * 4 * 9, 8 * 36 * 100), 9);
        check_filter_gradient(11, 4, 12, 12, 8, [3, 3], [1, 1], [1, 1], 1);
        // Strides, padding and groups, in runs.
        check_filter_gradient(40, 6, 15, 13, 12, [3, 2], [2, 1], [1, 0], 3);
        // One image of many pixels: one run, the product split instead.
        check_filter_gradient(1, 16, 40, 40, 16, [5, 5], [1, 1], [2, 2], 1);
        // No images: a zero gradient.
        check_filter_gradient(0, 2, 5, 5, 2, [3, 3], [1, 1], [0, 0], 1);
    }

    /// Runs copied in groups of 16: the run's values land in place, what
    /// comes before is untouched, and near either slice's end the copy
    /// stops exactly.
    #[test]
    fn runs_are_copied_in_groups_without_leaving_their_slices() {
        let src: Vec<u32> = (0..100).collect();
        for (at, from, len) in [(0, 0, 0), (3, 5, 7), (10, 60, 40), (0, 90, 10), (70, 0, 30)] {
            let mut dst = vec![u32::MAX; 100];
            copy_run(&mut dst, at, &src, from, len);
            assert!(dst[..at].iter().all(|&v| v == u32::MAX));
            assert_eq!(
                &dst[at..at + len],
                &src[from..from + len],
                "{at} {from} {len}"
            );
        }
    }

    /// Strided im2col copies, through every special case and the general
    /// one, at lengths that end on and off a group.
    #[test]
    fn strided_copies_take_every_stride_th_value() {
        let src: Vec<u32> = (0..200).collect();
        for stride in 1..=5 {
            for n in 1..=37 {
                let taps = &src[3..][..(n - 1) * stride + 1];
                let mut out = vec![u32::MAX; n];
                copy_strided(&mut out, taps, stride);
                let want: Vec<u32> = (0..n).map(|i| taps[i * stride]).collect();
                assert_eq!(out, want, "stride {stride}, {n} values");
            }
        }
    }

    /// Images of more output pixels than one block (see `pixel_block`):
    /// blocks that start and end inside an output row, padded edges on
    /// either side of a block, strided and dilated taps, and a last block
    /// shorter than the others.
    #[test]
    fn conv2d_in_pixel_blocks_matches_reference() {
        assert_eq!(pixel_block(64 * 9, 21 * 19), 128);
        check_conv(1, 64, 21, 19, 5, [3, 3], [1, 1], [1, 1], [1, 1], 1);
        check_conv(1, 64, 23, 30, 3, [3, 3], [1, 2], [2, 1], [2, 1], 1);
        check_conv(2, 64, 17, 17, 4, [3, 3], [1, 1], [1, 1], [1, 1], 2);
        check_conv(1, 16, 40, 40, 2, [2, 2], [1, 1], [0, 1], [1, 1], 1);
        // Padding wider than the image: taps wholly outside on both sides.
        check_conv(1, 64, 3, 27, 2, [7, 7], [1, 1], [3, 30], [1, 1], 1);
    }

    #[test]
    fn conv2d_matches_reference() {
        check_conv(1, 1, 5, 5, 1, [3, 3], [1, 1], [0, 0], [1, 1], 1);
        check_conv(2, 3, 8, 7, 4, [3, 3], [2, 1], [1, 2], [1, 1], 1);
        check_conv(2, 4, 9, 9, 6, [3, 2], [1, 2], [2, 0], [2, 1], 2);
        check_conv(1, 3, 4, 4, 3, [1, 1], [1, 1], [0, 0], [1, 1], 3);
        check_conv(2, 5, 6, 6, 4, [1, 1], [1, 1], [0, 0], [1, 1], 1);
        check_conv(3, 8, 28, 28, 16, [5, 5], [1, 1], [2, 2], [1, 1], 1);
        check_conv(0, 2, 4, 4, 2, [3, 3], [1, 1], [0, 0], [1, 1], 1);
    }

    #[test]
    fn depthwise_convolutions_match_reference() {
        // One input channel per group, one and two output channels each.
        check_conv(2, 6, 9, 11, 6, [3, 3], [1, 1], [1, 1], [1, 1], 6);
        check_conv(1, 4, 10, 13, 8, [3, 5], [2, 3], [2, 4], [2, 2], 4);
        // Padding wider than the image: rows and columns of taps that
        // read only padding, on both sides.
        check_conv(1, 3, 3, 4, 3, [5, 5], [1, 2], [4, 6], [1, 1], 3);
        check_conv(1, 2, 4, 3, 2, [2, 2], [3, 1], [0, 5], [1, 3], 2);
        // A single channel is a group of one too.
        check_conv(2, 1, 7, 5, 1, [3, 3], [1, 1], [1, 1], [1, 1], 1);
        // ShuffleNet's stride-2 layer, large enough to split across threads.
        check_conv(1, 120, 28, 28, 120, [3, 3], [2, 2], [1, 1], [1, 1], 120);
    }

    /// The plane loops give the same bits at every instruction set this
    /// CPU has (baseline only under Miri), NaNs included.
    #[test]
    fn plane_loops_give_the_same_bits_at_every_level() {
        let levels: Vec<IsaLevel> = [IsaLevel::Baseline, IsaLevel::Avx2, IsaLevel::Avx512]
            .into_iter()
            .filter(|&l| l <= crate::isa::detected())
            .collect();
        let (h, w) = (7, 37);
        let mut plane: Vec<f32> = values(h * w, 4).iter().map(|&v| v as f32).collect();
        plane[40] = f32::NAN;
        let filter: Vec<f32> = values(9, 5).iter().map(|&v| v as f32).collect();
        for stride in [1, 2, 3] {
            let win = Window2d {
                kernel: [3, 3],
                stride: [stride, stride],
                padding: [1, 1],
                dilation: [1, 1],
            };
            let (oh, ow) = ((h + 2 - 3) / stride + 1, (w + 2 - 3) / stride + 1);
            let g = ConvGeometry {
                n: 1,
                c: 1,
                h,
                w,
                o: 1,
                oh,
                ow,
                groups: 1,
                win,
            };
            let run = |level: IsaLevel| {
                let mut padded = PaddedPlane::default();
                let mut pooled = vec![0f32; oh * ow];
                max_pool_plane_on(level, &mut padded, &plane, (h, w), win, ow, &mut pooled);
                let mut averaged = vec![0f32; oh * ow];
                let window = (win, false);
                avg_pool_plane_on(
                    level,
                    &mut padded,
                    &plane,
                    (h, w),
                    window,
                    ow,
                    &mut averaged,
                );
                let mut convolved = vec![0f32; oh * ow];
                depthwise_channel_on(level, &mut padded, &plane, &filter, &g, &mut convolved);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                (bits(&pooled), bits(&averaged), bits(&convolved))
            };
            let baseline = run(IsaLevel::Baseline);
            assert!(baseline.0.iter().any(|&b| f32::from_bits(b).is_nan()));
            for &level in &levels {
                assert_eq!(run(level), baseline, "{level:?}, stride {stride}");
            }
        }
    }

    #[test]
    fn depthwise_weights_over_padding_multiply_zeros() {
        // An infinite weight times the padding's zero is NaN, as in the
        // im2col product: only the centre's window lies inside the image.
        let got = run(
            &stagecraft_ops::CONV2D,
            &[
                DenseHostTensor::from_slice(&[1.0f32; 9], [1, 1, 3, 3]).unwrap(),
                DenseHostTensor::from_slice(&[f32::INFINITY; 9], [1, 1, 3, 3]).unwrap(),
            ],
            OpAttrs::new().set_dims("padding", &[1, 1]),
        )
        .unwrap();
        let got = got.as_slice::<f32>().unwrap();
        for (i, v) in got.iter().enumerate() {
            if i == 4 {
                assert_eq!(*v, f32::INFINITY);
            } else {
                assert!(v.is_nan(), "pixel {i}: {v}");
            }
        }
    }

    #[test]
    fn conv2d_half_precision() {
        let x: Vec<f16> = vec![f16::ONE; 16];
        let w: Vec<f16> = vec![f16::from_f32(0.5); 9];
        let got = run(
            &stagecraft_ops::CONV2D,
            &[
                DenseHostTensor::from_slice(&x, [1, 1, 4, 4]).unwrap(),
                DenseHostTensor::from_slice(&w, [1, 1, 3, 3]).unwrap(),
            ],
            &OpAttrs::new(),
        )
        .unwrap();
        assert_eq!(got.as_slice::<f16>().unwrap(), &[f16::from_f32(4.5); 4]);
    }

    fn check_pool(dims: [usize; 4], kernel: [usize; 2], stride: [usize; 2], pad: [usize; 2]) {
        let xv = values(dims.iter().product(), 3);
        let mut attrs = OpAttrs::new();
        attrs
            .set_dims("kernel", &kernel)
            .set_dims("stride", &stride)
            .set_dims("padding", &pad);
        let x = DenseHostTensor::from_slice(&xv, dims).unwrap();
        let got = run(
            &stagecraft_ops::MAX_POOL2D,
            std::slice::from_ref(&x),
            &attrs,
        )
        .unwrap();
        close(
            got.as_slice::<f64>().unwrap(),
            &reference::max_pool2d(&xv, dims, kernel, stride, pad),
            0.0,
        );
        // f32 takes the vector path of its own lane width; its values are
        // exact in f64, so the reference over them is exact too.
        let narrow: Vec<f32> = xv.iter().map(|&v| v as f32).collect();
        let x32 = DenseHostTensor::from_slice(&narrow, dims).unwrap();
        let got = run(&stagecraft_ops::MAX_POOL2D, &[x32], &attrs).unwrap();
        let wide: Vec<f64> = narrow.iter().map(|&v| v as f64).collect();
        let want = reference::max_pool2d(&wide, dims, kernel, stride, pad);
        let got = widened(&got);
        close(&got, &want, 0.0);
        for include in [true, false] {
            attrs.set_bool("count_include_pad", include);
            let got = run(
                &stagecraft_ops::AVG_POOL2D,
                std::slice::from_ref(&x),
                &attrs,
            )
            .unwrap();
            close(
                got.as_slice::<f64>().unwrap(),
                &reference::avg_pool2d(&xv, dims, kernel, stride, pad, include),
                1e-12,
            );
            let x32 = DenseHostTensor::from_slice(&narrow, dims).unwrap();
            let got = run(&stagecraft_ops::AVG_POOL2D, &[x32], &attrs).unwrap();
            let want = reference::avg_pool2d(&wide, dims, kernel, stride, pad, include);
            let got = widened(&got);
            close(&got, &want, 1e-6);
        }
    }

    #[test]
    fn pooling_matches_reference() {
        check_pool([1, 1, 4, 4], [2, 2], [2, 2], [0, 0]);
        check_pool([2, 3, 7, 5], [3, 2], [2, 1], [1, 1]);
        check_pool([1, 2, 5, 5], [3, 3], [1, 1], [1, 0]);
        check_pool([1, 1, 1, 1], [1, 1], [1, 1], [0, 0]);
        // Rows where every window crosses an edge (no interior outputs),
        // windows wider than the padded row's interior, stride 3.
        check_pool([1, 2, 3, 2], [3, 3], [1, 1], [1, 1]);
        check_pool([1, 1, 4, 9], [2, 5], [1, 3], [0, 2]);
        check_pool([1, 3, 8, 13], [3, 3], [2, 2], [1, 1]);
        // Rows of several lane groups, the last one partial, at strides 1,
        // 2 and 3 (each has its own loop).
        check_pool([1, 2, 9, 37], [3, 3], [2, 2], [1, 1]);
        check_pool([1, 1, 20, 33], [3, 3], [1, 1], [1, 1]);
        check_pool([2, 2, 11, 40], [2, 2], [2, 2], [0, 0]);
        check_pool([1, 2, 10, 70], [3, 4], [3, 3], [1, 2]);
        // Planes with no columns or no rows: every window is padding.
        check_pool([1, 2, 3, 0], [1, 2], [1, 2], [0, 1]);
        check_pool([2, 1, 0, 4], [2, 1], [1, 1], [1, 0]);
    }

    #[test]
    fn max_pool_propagates_nan() {
        let x = DenseHostTensor::from_slice(&[1.0f32, f32::NAN, 3.0, 4.0], [1, 1, 2, 2]).unwrap();
        let mut attrs = OpAttrs::new();
        attrs.set_ints("kernel", &[2, 2]);
        assert!(run(&stagecraft_ops::MAX_POOL2D, &[x], &attrs)
            .unwrap()
            .as_slice::<f32>()
            .unwrap()[0]
            .is_nan());
    }

    /// ConvTranspose2d against the direct reference in f64 and f32.
    #[allow(clippy::too_many_arguments)]
    fn check_conv_transpose(
        xd: [usize; 4],
        opg: usize,
        k: [usize; 2],
        stride: [usize; 2],
        pad: [usize; 2],
        output_pad: [usize; 2],
        dil: [usize; 2],
        groups: usize,
    ) {
        let wd = [xd[1], opg, k[0], k[1]];
        let (xv, wv) = (
            values(xd.iter().product(), 4),
            values(wd.iter().product(), 5),
        );
        let mut attrs = OpAttrs::new();
        attrs
            .set_dims("stride", &stride)
            .set_dims("padding", &pad)
            .set_dims("output_padding", &output_pad)
            .set_dims("dilation", &dil)
            .set_int("groups", groups as i64);
        let (want, want_dims) =
            reference::conv_transpose2d(&xv, xd, &wv, wd, stride, pad, output_pad, dil, groups);
        let got = run(
            &stagecraft_ops::CONV_TRANSPOSE2D,
            &[
                DenseHostTensor::from_slice(&xv, xd).unwrap(),
                DenseHostTensor::from_slice(&wv, wd).unwrap(),
            ],
            &attrs,
        )
        .unwrap();
        assert_eq!(got.shape().dims(), want_dims.as_slice());
        close(got.as_slice::<f64>().unwrap(), &want, 1e-12);
        let x32: Vec<f32> = xv.iter().map(|&v| v as f32).collect();
        let w32: Vec<f32> = wv.iter().map(|&v| v as f32).collect();
        let got = run(
            &stagecraft_ops::CONV_TRANSPOSE2D,
            &[
                DenseHostTensor::from_slice(&x32, xd).unwrap(),
                DenseHostTensor::from_slice(&w32, wd).unwrap(),
            ],
            &attrs,
        )
        .unwrap();
        let got = widened(&got);
        close(&got, &want, 1e-4);
    }

    #[test]
    fn conv_transpose2d_matches_reference() {
        check_conv_transpose([1, 1, 3, 3], 1, [3, 3], [1, 1], [0, 0], [0, 0], [1, 1], 1);
        check_conv_transpose([2, 4, 5, 4], 3, [3, 2], [2, 3], [1, 0], [1, 2], [1, 2], 2);
        check_conv_transpose([1, 3, 4, 4], 1, [1, 1], [1, 1], [0, 0], [0, 0], [1, 1], 3);
        check_conv_transpose([0, 2, 4, 4], 2, [3, 3], [2, 2], [1, 1], [1, 0], [1, 1], 1);
        check_conv_transpose([3, 8, 14, 14], 4, [4, 4], [2, 2], [1, 1], [0, 0], [1, 1], 1);
    }

    /// The geometry of one image and one channel group, for the
    /// im2col/col2im tests.
    fn image_geometry(
        (c, h, w): (usize, usize, usize),
        k: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
    ) -> Option<ConvGeometry> {
        let span = |i: usize| dilation[i] * (k[i] - 1) + 1;
        let extent = [h + 2 * padding[0], w + 2 * padding[1]];
        if extent[0] < span(0) || extent[1] < span(1) {
            return None;
        }
        Some(ConvGeometry {
            n: 1,
            c,
            h,
            w,
            o: 1,
            oh: (extent[0] - span(0)) / stride[0] + 1,
            ow: (extent[1] - span(1)) / stride[1] + 1,
            groups: 1,
            win: Window2d {
                kernel: k,
                stride,
                padding,
                dilation,
            },
        })
    }

    /// im2col's value at (patch row, output pixel), by its definition.
    fn tap(x: &[f64], g: &ConvGeometry, row: usize, pixel: usize) -> f64 {
        let [kh, kw] = g.win.kernel;
        let (ci, ki, kj) = (row / (kh * kw), row / kw % kh, row % kw);
        let (oy, ox) = (pixel / g.ow, pixel % g.ow);
        let iy =
            (oy * g.win.stride[0] + ki * g.win.dilation[0]) as isize - g.win.padding[0] as isize;
        let ix =
            (ox * g.win.stride[1] + kj * g.win.dilation[1]) as isize - g.win.padding[1] as isize;
        if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
            return 0.0;
        }
        x[(ci * g.h + iy as usize) * g.w + ix as usize]
    }

    /// Max and average pooling gradients against their definitions, one
    /// window at a time in row-major order and each window's taps row by
    /// row, bit for bit: overlapping and padded windows, ties and NaNs
    /// (the first maximum or first NaN takes the gradient), and the CNN's
    /// first pooling layer's size.
    #[test]
    fn pooling_gradients_follow_their_definitions_bit_for_bit() {
        // (dims, kernel, stride, padding)
        type Case = ([usize; 4], [usize; 2], [usize; 2], [usize; 2]);
        let cases: &[Case] = &[
            ([2, 3, 7, 9], [2, 2], [2, 2], [0, 0]),
            ([1, 2, 8, 8], [3, 3], [1, 2], [1, 1]),
            ([2, 1, 5, 6], [3, 2], [2, 1], [1, 0]),
            ([1, 1, 1, 4], [1, 3], [1, 1], [0, 1]),
            // 64 × 8 planes of 28 × 28: the CLI CNN's first pooling layer.
            ([64, 8, 28, 28], [2, 2], [2, 2], [0, 0]),
        ];
        for &(dims, kernel, stride, padding) in cases {
            let [n, c, h, w] = dims;
            let win = Window2d {
                kernel,
                stride,
                padding,
                dilation: [1, 1],
            };
            let out = |i: usize| (dims[2 + i] + 2 * padding[i] - kernel[i]) / stride[i] + 1;
            let (oh, ow) = (out(0), out(1));
            // Few distinct values, so windows hold ties; some NaNs.
            let x: Vec<f32> = (0..n * c * h * w)
                .map(|i| match i % 17 {
                    5 => f32::NAN,
                    k => (k % 4) as f32,
                })
                .collect();
            let g: Vec<f32> = (0..n * c * oh * ow)
                .map(|i| 0.25 + (i % 7) as f32)
                .collect();
            let xt = DenseHostTensor::from_slice(&x, dims).unwrap();
            let gt = DenseHostTensor::from_slice(&g, [n, c, oh, ow]).unwrap();
            for mode in [None, Some(true), Some(false)] {
                let mut want = vec![0.0f32; x.len()];
                for p in 0..n * c {
                    for oy in 0..oh {
                        let (ys, ye) = window_span(oy, 0, h, win);
                        for ox in 0..ow {
                            let (xs, xe) = window_span(ox, 1, w, win);
                            let go = g[(p * oh + oy) * ow + ox];
                            let taps: Vec<usize> = (ys..ye)
                                .flat_map(|iy| (xs..xe).map(move |ix| p * h * w + iy * w + ix))
                                .collect();
                            match mode {
                                None => {
                                    let mut best = taps[0];
                                    for &t in &taps[1..] {
                                        let (b, v) = (x[best], x[t]);
                                        if !b.is_nan() && (v.is_nan() || v > b) {
                                            best = t;
                                        }
                                    }
                                    want[best] += go;
                                }
                                Some(include_pad) => {
                                    let full = (kernel[0] * kernel[1]) as f32;
                                    let divisor =
                                        if include_pad { full } else { taps.len() as f32 };
                                    for &t in &taps {
                                        want[t] += go / divisor;
                                    }
                                }
                            }
                        }
                    }
                }
                let got = pool_grad_typed::<f32>(&xt, &gt, win, mode).unwrap();
                let got = got.as_slice::<f32>().unwrap();
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{dims:?} {mode:?} at {i}: {a} vs {b}"
                    );
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Any range of output pixels (starting and ending mid-row) gets
        /// exactly the columns the definition gives, padding as zeros; and
        /// col2im adds each column value into the pixel it was read from,
        /// in patch-row order, bit for bit as one addition at a time.
        #[test]
        fn im2col_and_col2im_follow_their_definitions(
            c in 1usize..3, h in 1usize..9, w in 1usize..9, kh in 1usize..4, kw in 1usize..4,
            sh in 1usize..4, sw in 1usize..4, ph in 0usize..3, pw in 0usize..3,
            dh in 1usize..3, dw in 1usize..3, start in 0usize..40, len in 0usize..80,
        ) {
            let g = image_geometry((c, h, w), [kh, kw], [sh, sw], [ph, pw], [dh, dw]);
            prop_assume!(g.is_some());
            let g = g.unwrap();
            let (pixels, patch) = (g.oh * g.ow, c * kh * kw);
            let x = values(c * h * w, 3);
            let start = start % pixels;
            let range = start..(start + len).min(pixels);
            let mut cols = vec![f64::NAN; patch * range.len()];
            im2col_columns(&x, &g, 0, range.clone(), &mut cols);
            for row in 0..patch {
                for (at, pixel) in range.clone().enumerate() {
                    let got = cols[row * range.len() + at];
                    prop_assert_eq!(got.to_bits(), tap(&x, &g, row, pixel).to_bits());
                }
            }
            // col2im of arbitrary columns, against one addition per value.
            let cols = values(patch * pixels, 4);
            let mut got = values(c * h * w, 5);
            let mut want = got.clone();
            col2im(&cols, &g, 0, &mut got);
            let [kh, kw] = g.win.kernel;
            for row in 0..patch {
                let (ci, ki, kj) = (row / (kh * kw), row / kw % kh, row % kw);
                for pixel in 0..pixels {
                    let (oy, ox) = (pixel / g.ow, pixel % g.ow);
                    let iy = (oy * sh + ki * dh) as isize - ph as isize;
                    let ix = (ox * sw + kj * dw) as isize - pw as isize;
                    if iy >= 0 && ix >= 0 && iy < h as isize && ix < w as isize {
                        let at = (ci * h + iy as usize) * w + ix as usize;
                        want[at] += cols[row * pixels + pixel];
                    }
                }
            }
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&got), bits(&want));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn conv2d_random_geometry(
            n in 1usize..3, cpg in 1usize..3, groups in 1usize..3, opg in 1usize..3,
            h in 1usize..7, w in 1usize..7, kh in 1usize..4, kw in 1usize..4,
            sh in 1usize..3, sw in 1usize..3, ph in 0usize..2, pw in 0usize..2, dh in 1usize..3,
        ) {
            let span = dh * (kh - 1) + 1;
            prop_assume!(h + 2 * ph >= span && w + 2 * pw >= kw);
            check_conv(n, cpg * groups, h, w, opg * groups, [kh, kw], [sh, sw], [ph, pw], [dh, 1], groups);
        }

        #[test]
        fn conv_transpose2d_random_geometry(
            n in 1usize..3, cpg in 1usize..3, groups in 1usize..3, opg in 1usize..3,
            h in 1usize..6, w in 1usize..6, kh in 1usize..4, kw in 1usize..4,
            sh in 1usize..4, sw in 1usize..3, ph in 0usize..2, pw in 0usize..2,
            dh in 1usize..3, dw in 1usize..3, oph in 0usize..3, opw in 0usize..3,
        ) {
            let (oph, opw) = (oph % sh, opw % sw);
            let full_h = (h - 1) * sh + dh * (kh - 1) + oph + 1;
            let full_w = (w - 1) * sw + dw * (kw - 1) + opw + 1;
            prop_assume!(full_h > 2 * ph && full_w > 2 * pw);
            check_conv_transpose(
                [n, cpg * groups, h, w], opg, [kh, kw], [sh, sw], [ph, pw], [oph, opw], [dh, dw], groups,
            );
        }
    }
}
