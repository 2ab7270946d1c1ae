//! Convolution and pooling kernels (NCHW, f32): forward and gradients.
//!
//! The three convolution products are implicit GEMMs per channel group,
//! their operands read straight from the tensors (no im2col buffer):
//!
//! | product | M | N | K | A | B |
//! | --- | --- | --- | --- | --- | --- |
//! | forward | out channels | images·out pixels | in channels·taps | w | x at the tap |
//! | input gradient | in channels | images·in pixels | out channels·taps | w | g where the tap lands |
//! | filter gradient | out channels | in channels·taps | images·out pixels | g | x at the tap |
//!
//! So no thread ever adds into another's result: the input gradient
//! gathers, for each input pixel, the output gradients whose windows hold
//! it, and the filter gradient is a reduction per filter element (split
//! along K into partial sums added in a second pass when there are too few
//! filter elements to fill the device). `ConvTranspose2d` is the input
//! gradient's product, as on the CPU.
//!
//! Which products enter each sum follows the CPU's im2col and GEMM, for
//! NaN and infinity to land where they land there: the forward and filter
//! products multiply padding taps as zeros (`0 · ∞` is NaN on both), while
//! the input gradient leaves out taps that fall outside the output, which
//! the CPU's col2im drops after its product.

use crate::context::Gpu;
use crate::kernels::{grid, launch, one, small, Outputs};
use crate::registry::{kernel, Accepts, GpuKernel};
use crate::shader::{self, PRELUDE, WORKGROUP};
use stagecraft_ops::{conv2d_window, defs, pool_window, Attrs, Window2d};
use stagecraft_tensor::{DType, DeviceTensor, Result, TensorMetadata};

/// The entries of this family: f32 inputs, each kernel checking that its
/// tensors are of rank 4.
pub(crate) fn register(table: &mut Vec<GpuKernel>) {
    use Accepts::AllF32;
    table.extend([
        kernel(&defs::CONV2D, AllF32, |g, _, a, i, o| {
            product_entry(g, Product::Forward, a, i, o)
        }),
        // A transposed convolution is the input gradient of the
        // convolution with its window, as on the CPU: its input plays the
        // output gradient, its output the convolution's image.
        kernel(&defs::CONV2D_BACKPROP_INPUT, AllF32, |g, _, a, i, o| {
            product_entry(g, Product::InputGradient, a, i, o)
        }),
        kernel(&defs::CONV_TRANSPOSE2D, AllF32, |g, _, a, i, o| {
            product_entry(g, Product::InputGradient, a, i, o)
        }),
        kernel(&defs::CONV2D_BACKPROP_FILTER, AllF32, |g, _, a, i, o| {
            product_entry(g, Product::FilterGradient, a, i, o)
        }),
        kernel(&defs::MAX_POOL2D, AllF32, |g, _, a, i, o| {
            pool_entry(g, false, false, a, i, o)
        }),
        kernel(&defs::AVG_POOL2D, AllF32, |g, _, a, i, o| {
            pool_entry(g, true, false, a, i, o)
        }),
        kernel(&defs::MAX_POOL2D_GRAD, AllF32, |g, _, a, i, o| {
            pool_entry(g, false, true, a, i, o)
        }),
        kernel(&defs::AVG_POOL2D_GRAD, AllF32, |g, _, a, i, o| {
            pool_entry(g, true, true, a, i, o)
        }),
    ]);
}

/// The one output of a convolution or pooling when it and every input
/// are f32 tensors of rank 4; `None` otherwise (the CPU runs it).
fn nchw<'a>(inputs: &[&DeviceTensor], outputs: &'a [TensorMetadata]) -> Option<&'a TensorMetadata> {
    let [out] = outputs else {
        return None;
    };
    let supported = out.dtype == DType::F32
        && out.shape.rank() == 4
        && inputs
            .iter()
            .all(|t| t.metadata().dtype == DType::F32 && t.metadata().shape.rank() == 4);
    supported.then_some(out)
}

fn product_entry(
    gpu: &'static Gpu,
    product: Product,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    match nchw(inputs, outputs) {
        Some(out) => conv_run(gpu, product, attrs, inputs, out),
        None => Ok(None),
    }
}

/// A pooling: `average` or max, forward or its `gradient`.
fn pool_entry(
    gpu: &'static Gpu,
    average: bool,
    gradient: bool,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    match nchw(inputs, outputs) {
        Some(out) => pool_run(gpu, average, gradient, attrs, inputs, out),
        None => Ok(None),
    }
}

fn dims(t: &DeviceTensor) -> &[usize] {
    t.metadata().shape.dims()
}

/// A convolution product from the op's operands: `(x, w)` forward, `(g,
/// w)` for the input gradient, `(x, g)` for the filter gradient.
fn conv_run(
    gpu: &'static Gpu,
    product: Product,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let &[first, second] = inputs else {
        return Ok(None);
    };
    let out_dims = out.shape.dims();
    let (geo, a, b) = match product {
        Product::Forward => (
            Conv::new(dims(first), dims(second), out_dims, attrs)?,
            second,
            first,
        ),
        Product::InputGradient => (
            Conv::new(out_dims, dims(second), dims(first), attrs)?,
            second,
            first,
        ),
        Product::FilterGradient => (
            Conv::new(dims(first), out_dims, dims(second), attrs)?,
            second,
            first,
        ),
    };
    match geo {
        Some(geo) => conv_product(gpu, product, &geo, a, b, out),
        None => Ok(None),
    }
}

/// A pooling from the op's operands: `x` forward, `(x, g)` for the
/// gradients.
fn pool_run(
    gpu: &'static Gpu,
    average: bool,
    gradient: bool,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let win = pool_window(attrs)?;
    let include_pad = average && attrs.bool("count_include_pad")?;
    let out_dims = out.shape.dims();
    if !gradient {
        let &[x] = inputs else {
            return Ok(None);
        };
        let Some(words) = pool_words(dims(x), out_dims, win, include_pad) else {
            return Ok(None);
        };
        let kernel = match average {
            true => PoolKernel::Average,
            false => PoolKernel::Max,
        };
        return pool_launch(gpu, &pool_shader(kernel), &[x], out, words).map(Some);
    }
    let &[x, g] = inputs else {
        return Ok(None);
    };
    if dims(x) != out_dims {
        return Ok(None);
    }
    let Some(words) = pool_words(out_dims, dims(g), win, include_pad) else {
        return Ok(None);
    };
    if average {
        let source = pool_shader(PoolKernel::AverageGradient);
        return pool_launch(gpu, &source, &[g], out, words).map(Some);
    }
    // Each window's maximum is found once, then every input pixel gathers
    // the gradients of the windows whose maximum it is.
    let at_meta = TensorMetadata::new(DType::I32, g.metadata().shape.clone());
    let source = pool_shader(PoolKernel::ArgMax);
    let at = pool_launch(gpu, &source, &[x], &at_meta, words)?;
    let source = pool_shader(PoolKernel::MaxGradient);
    pool_launch(gpu, &source, &[&at[0], g], out, words).map(Some)
}

/// The largest size the shaders' signed index arithmetic holds.
const I32_MAX: usize = i32::MAX as usize;

/// The product of `dims`, `None` if it overflows.
fn product_of(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |p, &d| p.checked_mul(d))
}

/// A convolution of images `[n, c, h, w]` with filters `[o, cg, kh, kw]`
/// into `[n, o, oh, ow]`, whichever of the three its op computes.
struct Conv {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    oh: usize,
    ow: usize,
    win: Window2d,
    groups: usize,
    cg: usize,
    og: usize,
}

impl Conv {
    /// The convolution of `x` with `w` into `y` (dimensions of the
    /// forward op), or `None` where these do not describe one or its
    /// indices would overflow the shaders' 32-bit arithmetic (the CPU's
    /// kernel then runs and reports what it reports).
    fn new(x: &[usize], w: &[usize], y: &[usize], attrs: &Attrs<'_>) -> Result<Option<Conv>> {
        let (&[n, c, h, wd], &[o, cg, kh, kw], &[yn, yo, oh, ow]) = (x, w, y) else {
            return Ok(None);
        };
        let groups = attrs.int("groups")?;
        let Ok(groups) = usize::try_from(groups) else {
            return Ok(None);
        };
        let fits = cg.checked_mul(groups) == Some(c) && o.checked_rem(groups) == Some(0);
        if !fits || n != yn || o != yo || kh * kw == 0 {
            return Ok(None);
        }
        let win = conv2d_window(attrs, [kh, kw])?;
        if win.output_dim(0, h).ok() != Some(oh) || win.output_dim(1, wd).ok() != Some(ow) {
            return Ok(None);
        }
        let geo = Conv {
            n,
            c,
            h,
            w: wd,
            o,
            oh,
            ow,
            win,
            groups,
            cg,
            og: o / groups,
        };
        let reach = |i: usize| {
            geo.win.padding[i]
                .checked_mul(2)?
                .checked_add([h, wd][i])?
                .checked_add(geo.win.stride[i].checked_mul([oh, ow][i])?)?
                .checked_add(geo.win.dilation[i].checked_mul(geo.win.kernel[i])?)
        };
        let sizes = [
            product_of(&[n, c, h, wd]),
            product_of(&[o, cg, kh, kw]),
            product_of(&[n, o, oh, ow]),
            reach(0),
            reach(1),
        ];
        Ok(sizes
            .iter()
            .all(|s| s.is_some_and(|s| s <= I32_MAX))
            .then_some(geo))
    }

    /// `[n, c, h, w, o, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, cg, og]`,
    /// each below 2^31 (checked in [`Conv::new`]).
    fn words(&self) -> [u32; 17] {
        let w = self.win;
        [
            self.n,
            self.c,
            self.h,
            self.w,
            self.o,
            self.oh,
            self.ow,
            w.kernel[0],
            w.kernel[1],
            w.stride[0],
            w.stride[1],
            w.padding[0],
            w.padding[1],
            w.dilation[0],
            w.dilation[1],
            self.cg,
            self.og,
        ]
        .map(|v| v as u32)
    }
}

/// Which product of a convolution a GEMM computes (the table at the top).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Product {
    Forward,
    InputGradient,
    FilterGradient,
}

impl Product {
    /// `[M, N, K]` of each group's product.
    fn sizes(self, g: &Conv) -> [usize; 3] {
        let taps = g.win.kernel[0] * g.win.kernel[1];
        match self {
            Product::Forward => [g.og, g.n * g.oh * g.ow, g.cg * taps],
            Product::InputGradient => [g.cg, g.n * g.h * g.w, g.og * taps],
            Product::FilterGradient => [g.og, g.cg * taps, g.n * g.oh * g.ow],
        }
    }

    /// The WGSL of `column`, `load_a`, `load_b` and `store` (see
    /// [`GEMM_HEAD`]).
    fn loaders(self) -> &'static str {
        match self {
            Product::Forward => FORWARD_LOADERS,
            Product::InputGradient => INPUT_GRADIENT_LOADERS,
            Product::FilterGradient => FILTER_GRADIENT_LOADERS,
        }
    }
}

/// How a GEMM is spread over threads.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Tiling {
    /// One thread per result: for a product of a few rows (depthwise
    /// convolutions), where a tile would mostly compute padding.
    Direct,
    /// A 256-thread workgroup per `16·rows × 64` block of results, each
    /// thread `rows × 4` of them, through [`BK`]-deep tiles of A and B in
    /// workgroup memory.
    Tiled { rows: u32 },
}

/// Columns of results per tile.
const BN: u32 = 64;
/// The depth along K of the tiles in workgroup memory.
const BK: u32 = 16;

impl Tiling {
    fn for_rows(m: usize) -> Tiling {
        match m {
            0..=4 => Tiling::Direct,
            5..=16 => Tiling::Tiled { rows: 1 },
            17..=32 => Tiling::Tiled { rows: 2 },
            _ => Tiling::Tiled { rows: 4 },
        }
    }
}

/// Bindings, the `params` words and the geometry every GEMM shader reads.
/// `params`: `[M, N, K, groups, column_tiles, row_tiles, row_width,
/// splits, chunk, count, then the 17 words of` [`Conv::words`]`]`.
/// `count` is the number of tiles (or threads) launched that do work;
/// split `s` sums K in `[s·chunk, (s+1)·chunk)`.
const GEMM_HEAD: &str = r#"
@group(0) @binding(0) var<storage, read> a_src: array<f32>;
@group(0) @binding(1) var<storage, read> b_src: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read> params: array<u32>;

struct Geometry {
    n: u32, c: u32, h: u32, w: u32, o: u32, oh: u32, ow: u32, kh: u32, kw: u32,
    sh: u32, sw: u32, ph: u32, pw: u32, dh: u32, dw: u32, cg: u32, og: u32,
}
var<private> geo: Geometry;
var<private> size_m: u32;
var<private> size_n: u32;
var<private> size_k: u32;
var<private> groups: u32;

fn load_geometry() {
    size_m = params[0];
    size_n = params[1];
    size_k = params[2];
    groups = params[3];
    geo = Geometry(params[10], params[11], params[12], params[13], params[14], params[15],
        params[16], params[17], params[18], params[19], params[20], params[21], params[22],
        params[23], params[24], params[25], params[26]);
}

// A or B of a nonfinite value: the input gradient must not let one
// meet a tap it leaves out.
fn wild(x: f32) -> bool { return (bitcast<u32>(x) & 0x7f800000u) == 0x7f800000u; }
"#;

/// Forward: `A[m, k] = w[grp·og + m, k]`, `B[k, col] = x` at tap `k` of
/// output pixel `col` (zero in the padding).
const FORWARD_LOADERS: &str = r#"
// An output pixel: its image's group of channels and its window's corner.
struct Column { base: u32, y0: i32, x0: i32 }

fn column(grp: u32, col: u32) -> Column {
    let pixels = geo.oh * geo.ow;
    let img = col / pixels;
    let pix = col % pixels;
    let oy = pix / geo.ow;
    let ox = pix % geo.ow;
    return Column((img * geo.c + grp * geo.cg) * geo.h * geo.w,
        i32(oy * geo.sh) - i32(geo.ph), i32(ox * geo.sw) - i32(geo.pw));
}

fn load_a(grp: u32, m: u32, k: u32) -> f32 {
    return a_src[(grp * geo.og + m) * size_k + k];
}

// (value, whether the product counts)
fn load_b(col: Column, k: u32) -> vec2<f32> {
    let taps = geo.kh * geo.kw;
    let ci = k / taps;
    let r = k % taps;
    let iy = col.y0 + i32((r / geo.kw) * geo.dh);
    let ix = col.x0 + i32((r % geo.kw) * geo.dw);
    if (iy < 0 || ix < 0 || u32(iy) >= geo.h || u32(ix) >= geo.w) { return vec2<f32>(0.0, 1.0); }
    return vec2<f32>(b_src[col.base + (ci * geo.h + u32(iy)) * geo.w + u32(ix)], 1.0);
}

fn store(split: u32, grp: u32, m: u32, col: u32, v: f32) {
    let pixels = geo.oh * geo.ow;
    out[((col / pixels) * geo.o + grp * geo.og + m) * pixels + col % pixels] = v;
}
"#;

/// Input gradient: `A[m, (oc, tap)] = w[grp·og + oc, m, tap]`, `B[(oc,
/// tap), col] = g[oc]` at the output pixel whose tap lands on input pixel
/// `col`, left out when there is none.
const INPUT_GRADIENT_LOADERS: &str = r#"
// An input pixel: its image's group of output channels and its place in
// the padded image.
struct Column { base: u32, y: i32, x: i32 }

fn column(grp: u32, col: u32) -> Column {
    let pixels = geo.h * geo.w;
    let img = col / pixels;
    let pix = col % pixels;
    return Column((img * geo.o + grp * geo.og) * geo.oh * geo.ow,
        i32(pix / geo.w + geo.ph), i32(pix % geo.w + geo.pw));
}

fn load_a(grp: u32, m: u32, k: u32) -> f32 {
    let taps = geo.kh * geo.kw;
    return a_src[((grp * geo.og + k / taps) * geo.cg + m) * taps + k % taps];
}

fn load_b(col: Column, k: u32) -> vec2<f32> {
    let taps = geo.kh * geo.kw;
    let oc = k / taps;
    let r = k % taps;
    let ty = col.y - i32((r / geo.kw) * geo.dh);
    let tx = col.x - i32((r % geo.kw) * geo.dw);
    if (ty < 0 || tx < 0) { return vec2<f32>(0.0, 0.0); }
    let oy = u32(ty) / geo.sh;
    let ox = u32(tx) / geo.sw;
    if (oy * geo.sh != u32(ty) || ox * geo.sw != u32(tx) || oy >= geo.oh || ox >= geo.ow) {
        return vec2<f32>(0.0, 0.0);
    }
    return vec2<f32>(b_src[col.base + (oc * geo.oh + oy) * geo.ow + ox], 1.0);
}

fn store(split: u32, grp: u32, m: u32, col: u32, v: f32) {
    let pixels = geo.h * geo.w;
    out[((col / pixels) * geo.c + grp * geo.cg + m) * pixels + col % pixels] = v;
}
"#;

/// Filter gradient: `A[m, k] = g[grp·og + m]` at output pixel `k` (of
/// every image), `B[k, (ci, tap)] = x[grp·cg + ci]` at that tap of that
/// pixel's window (zero in the padding). Split `s` writes partial sums at
/// `s·groups·M·N`.
const FILTER_GRADIENT_LOADERS: &str = r#"
// A filter element: its input channel's plane and its tap's offset from
// a window's corner.
struct Column { base: u32, dy: i32, dx: i32 }

fn column(grp: u32, col: u32) -> Column {
    let taps = geo.kh * geo.kw;
    let r = col % taps;
    return Column((grp * geo.cg + col / taps) * geo.h * geo.w,
        i32((r / geo.kw) * geo.dh) - i32(geo.ph), i32((r % geo.kw) * geo.dw) - i32(geo.pw));
}

fn load_a(grp: u32, m: u32, k: u32) -> f32 {
    let pixels = geo.oh * geo.ow;
    return a_src[((k / pixels) * geo.o + grp * geo.og + m) * pixels + k % pixels];
}

fn load_b(col: Column, k: u32) -> vec2<f32> {
    let pixels = geo.oh * geo.ow;
    let img = k / pixels;
    let pix = k % pixels;
    let iy = i32((pix / geo.ow) * geo.sh) + col.dy;
    let ix = i32((pix % geo.ow) * geo.sw) + col.dx;
    if (iy < 0 || ix < 0 || u32(iy) >= geo.h || u32(ix) >= geo.w) { return vec2<f32>(0.0, 1.0); }
    return vec2<f32>(b_src[img * geo.c * geo.h * geo.w + col.base + u32(iy) * geo.w + u32(ix)], 1.0);
}

fn store(split: u32, grp: u32, m: u32, col: u32, v: f32) {
    out[((split * groups + grp) * size_m + m) * size_n + col] = v;
}
"#;

/// The WGSL of `product` spread as `tiling`.
fn gemm_shader(product: Product, tiling: Tiling) -> String {
    let loaders = product.loaders();
    let body = match tiling {
        Tiling::Direct => DIRECT_MAIN.to_string(),
        Tiling::Tiled { rows } => tiled_main(rows, product == Product::InputGradient),
    };
    format!("{GEMM_HEAD}{loaders}{body}")
}

/// One thread per result of one split, over `count` threads in rows of
/// `row_width`.
const DIRECT_MAIN: &str = r#"
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    load_geometry();
    let i = id.x + id.y * params[6];
    if (i >= params[9]) { return; }
    let col = i % size_n;
    var rest = i / size_n;
    let m = rest % size_m;
    rest = rest / size_m;
    let grp = rest % groups;
    let split = rest / groups;
    let k_begin = split * params[8];
    let k_end = min(size_k, k_begin + params[8]);
    let info = column(grp, col);
    var acc = 0.0;
    for (var k = k_begin; k < k_end; k = k + 1u) {
        let b = load_b(info, k);
        if (b.y != 0.0) { acc = fma(load_a(grp, m, k), b.x, acc); }
    }
    store(split, grp, m, col, acc);
}
"#;

/// The tiled GEMM: `16·rows × 64` results per workgroup of 256 threads,
/// thread `(ty, tx)` holding rows `ty + 16i` and columns `tx + 16j`.
///
/// With `masked`, B carries which products count; a product left out
/// contributes nothing even when A is infinite or NaN there. Checking
/// that per product would slow every tile, so each tile of A is scanned
/// for nonfinite values as it is loaded (into a flag in workgroup memory,
/// two flags in turn so one step's reset cannot race the next step's
/// loads) and only the tiles that hold one take the checked loop.
fn tiled_main(rows: u32, masked: bool) -> String {
    let bm = 16 * rows;
    let (tile_a, tile_b) = (BK * bm, BK * BN);
    let (keep_decl, flag_reset, flag_set, keep_store, careful, careful_loop) = if masked {
        (
            format!(
                "var<workgroup> keep_b: array<u32, {tile_b}>;\nvar<workgroup> wild_tile: array<atomic<u32>, 2>;\n"
            ),
            "if (tid == 0u) { atomicStore(&wild_tile[0], 0u); atomicStore(&wild_tile[1], 0u); }\n    workgroupBarrier();",
            "if (wild(v)) { atomicOr(&wild_tile[slot], 1u); }",
            "keep_b[kr * BN + b_n] = u32(v.y != 0.0);",
            "let careful = atomicLoad(&wild_tile[slot]) != 0u;\n        if (tid == 0u) { atomicStore(&wild_tile[slot ^ 1u], 0u); }",
            r#"if (careful) {
            for (var kk = 0u; kk < BK; kk = kk + 1u) {
                for (var i = 0u; i < ROWS; i = i + 1u) {
                    let a = tile_a[kk * BM + ty + 16u * i];
                    for (var j = 0u; j < 4u; j = j + 1u) {
                        let at = kk * BN + tx + 16u * j;
                        if (keep_b[at] != 0u) { acc[i * 4u + j] = fma(a, tile_b[at], acc[i * 4u + j]); }
                    }
                }
            }
        } else "#,
        )
    } else {
        (String::new(), "", "", "", "", "")
    };
    format!(
        r#"
const ROWS: u32 = {rows}u;
const BM: u32 = {bm}u;
const BN: u32 = {BN}u;
const BK: u32 = {BK}u;
var<workgroup> tile_a: array<f32, {tile_a}>;
var<workgroup> tile_b: array<f32, {tile_b}>;
{keep_decl}
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) group: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {{
    load_geometry();
    let column_tiles = params[4];
    let row_tiles = params[5];
    let t = group.x + group.y * params[6];
    let live = t < params[9];
    let col_tile = t % column_tiles;
    var rest = t / column_tiles;
    let row_tile = rest % row_tiles;
    rest = rest / row_tiles;
    let grp = rest % groups;
    let split = rest / groups;
    let k_begin = split * params[8];
    let k_end = min(size_k, k_begin + params[8]);
    // Each thread loads B at one column and A at one depth, every step.
    let b_n = tid % BN;
    let b_col = col_tile * BN + b_n;
    let b_live = live && b_col < size_n;
    let info = column(grp, min(b_col, size_n - 1u));
    let a_k = tid % BK;
    let tx = tid % 16u;
    let ty = tid / 16u;
    var acc: array<f32, {results}>;
    {flag_reset}
    var step = 0u;
    for (var k0 = k_begin; k0 < k_end; k0 = k0 + BK) {{
        let slot = step & 1u;
        for (var j = 0u; j < ROWS; j = j + 1u) {{
            let m = tid / BK + 16u * j;
            let row = row_tile * BM + m;
            let k = k0 + a_k;
            var v = 0.0;
            if (live && row < size_m && k < k_end) {{ v = load_a(grp, row, k); }}
            tile_a[a_k * BM + m] = v;
            {flag_set}
        }}
        for (var j = 0u; j < BK * BN / 256u; j = j + 1u) {{
            let kr = tid / BN + (256u / BN) * j;
            let k = k0 + kr;
            var v = vec2<f32>(0.0, 1.0);
            if (b_live && k < k_end) {{ v = load_b(info, k); }}
            tile_b[kr * BN + b_n] = v.x;
            {keep_store}
        }}
        workgroupBarrier();
        {careful}
        {careful_loop}{{
            for (var kk = 0u; kk < BK; kk = kk + 1u) {{
                var b: array<f32, 4>;
                for (var j = 0u; j < 4u; j = j + 1u) {{ b[j] = tile_b[kk * BN + tx + 16u * j]; }}
                for (var i = 0u; i < ROWS; i = i + 1u) {{
                    let a = tile_a[kk * BM + ty + 16u * i];
                    for (var j = 0u; j < 4u; j = j + 1u) {{
                        acc[i * 4u + j] = fma(a, b[j], acc[i * 4u + j]);
                    }}
                }}
            }}
        }}
        workgroupBarrier();
        step = step + 1u;
    }}
    if (!live) {{ return; }}
    for (var i = 0u; i < ROWS; i = i + 1u) {{
        let row = row_tile * BM + ty + 16u * i;
        for (var j = 0u; j < 4u; j = j + 1u) {{
            let col = col_tile * BN + tx + 16u * j;
            if (row < size_m && col < size_n) {{ store(split, grp, row, col, acc[i * 4u + j]); }}
        }}
    }}
}}
"#,
        results = rows * 4,
    )
}

/// Workgroups (tiled) or threads (direct) worth splitting a filter
/// gradient's long sums for: below this a device sits mostly idle.
const TARGET_TILES: usize = 256;
const TARGET_THREADS: usize = 1 << 16;
/// The shortest stretch of K a split sums, so the second pass stays small.
const MIN_CHUNK: usize = 512;

/// Launches one of the three products of `geo` with operands `a` and `b`
/// (see the table at the top) into a new tensor of `out`.
fn conv_product(
    gpu: &'static Gpu,
    product: Product,
    geo: &Conv,
    a: &DeviceTensor,
    b: &DeviceTensor,
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let [m, n, k] = product.sizes(geo);
    if m == 0 || n == 0 || k == 0 {
        // Empty sums are zeros, which the CPU's kernel writes.
        return Ok(None);
    }
    let tiling = Tiling::for_rows(m);
    let (column_tiles, row_tiles) = match tiling {
        Tiling::Direct => (1, 1),
        Tiling::Tiled { rows } => (n.div_ceil(BN as usize), m.div_ceil(16 * rows as usize)),
    };
    let units = match tiling {
        Tiling::Direct => m * n * geo.groups,
        Tiling::Tiled { .. } => column_tiles * row_tiles * geo.groups,
    };
    let splits = if product == Product::FilterGradient {
        let target = match tiling {
            Tiling::Direct => TARGET_THREADS,
            Tiling::Tiled { .. } => TARGET_TILES,
        };
        target.div_ceil(units).min(k.div_ceil(MIN_CHUNK)).max(1)
    } else {
        1
    };
    let chunk = k.div_ceil(splits).next_multiple_of(BK as usize);
    let splits = k.div_ceil(chunk);
    let count = units * splits;
    let results = geo.groups * m * n;
    let Some(sizes) = [
        m,
        n,
        k,
        geo.groups,
        column_tiles,
        row_tiles,
        splits,
        chunk,
        count,
        results * splits,
    ]
    .iter()
    .map(|&v| small(v))
    .collect::<Option<Vec<u32>>>() else {
        return Ok(None);
    };
    let pipeline = gpu.pipeline(&gemm_shader(product, tiling))?;
    let (gx, gy, row_width) = match tiling {
        Tiling::Direct => {
            let (gx, gy) = grid(sizes[8].div_ceil(WORKGROUP));
            (gx, gy, gx * WORKGROUP)
        }
        Tiling::Tiled { .. } => {
            let (gx, gy) = grid(sizes[8]);
            (gx, gy, gx)
        }
    };
    let mut params = vec![
        sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5], row_width, sizes[6], sizes[7],
        sizes[8],
    ];
    params.extend(geo.words());
    let y = gpu.alloc(out.clone())?;
    if splits == 1 {
        launch(gpu, &pipeline, &[a, b, &y], &params, (gx, gy, 1))?;
        return Ok(Some(one(y)));
    }
    let partial = gpu.alloc(TensorMetadata::new(DType::F32, [results * splits]))?;
    launch(gpu, &pipeline, &[a, b, &partial], &params, (gx, gy, 1))?;
    let results = results as u32;
    let (gx, gy) = grid(results.div_ceil(WORKGROUP));
    let sum = gpu.pipeline(&shader::part_sums())?;
    launch(
        gpu,
        &sum,
        &[&partial, &y],
        &[results, gx * WORKGROUP, splits as u32, results, 0],
        (gx, gy, 1),
    )?;
    Ok(Some(one(y)))
}

/// The five pooling kernels, one thread per output (forward) or per
/// input pixel (gradients).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum PoolKernel {
    Max,
    Average,
    /// The flat index in its plane of each window's maximum: the first in
    /// row-major order, or the first NaN, as the CPU's gradient picks.
    ArgMax,
    /// Gathers the gradients of the windows whose [`PoolKernel::ArgMax`]
    /// is this pixel.
    MaxGradient,
    /// Gathers each covering window's gradient over the divisor its
    /// average used.
    AverageGradient,
}

/// `params` of the pooling kernels after `[count, row_width]`: `[h, w,
/// oh, ow, kh, kw, sh, sw, ph, pw, include_pad]` of an input `[.., h, w]`
/// pooled into `[.., oh, ow]`; `None` (the CPU runs) where these do not
/// describe a pooling or exceed 32-bit indices.
fn pool_words(x: &[usize], y: &[usize], win: Window2d, include_pad: bool) -> Option<[u32; 11]> {
    let (&[n, c, h, w], &[yn, yc, oh, ow]) = (x, y) else {
        return None;
    };
    if n != yn || c != yc || win.output_dim(0, h).ok()? != oh || win.output_dim(1, w).ok()? != ow {
        return None;
    }
    let fits = |v: Option<usize>| v.is_some_and(|v| v <= I32_MAX);
    let reach = |i: usize| {
        win.stride[i]
            .checked_mul([oh, ow][i])?
            .checked_add(win.kernel[i])?
            .checked_add([h, w][i])?
            .checked_add(win.padding[i])
    };
    let all_fit = fits(product_of(&[n, c, h, w]))
        && fits(product_of(&[n, c, oh, ow]))
        && fits(reach(0))
        && fits(reach(1));
    all_fit.then(|| {
        [
            h,
            w,
            oh,
            ow,
            win.kernel[0],
            win.kernel[1],
            win.stride[0],
            win.stride[1],
            win.padding[0],
            win.padding[1],
            include_pad as usize,
        ]
        .map(|v| v as u32)
    })
}

/// Window arithmetic the pooling kernels share.
const POOL_HEAD: &str = r#"
struct Pool { h: u32, w: u32, oh: u32, ow: u32, kh: u32, kw: u32, sh: u32, sw: u32, ph: u32, pw: u32, include_pad: u32 }
var<private> pool: Pool;

fn load_pool() {
    pool = Pool(params[2], params[3], params[4], params[5], params[6], params[7], params[8],
        params[9], params[10], params[11], params[12]);
}

// The in-bounds taps of window (oy, ox): rows [r.x, r.y), columns [r.z, r.w).
fn window(oy: u32, ox: u32) -> vec4<i32> {
    let y0 = i32(oy * pool.sh) - i32(pool.ph);
    let x0 = i32(ox * pool.sw) - i32(pool.pw);
    return vec4<i32>(max(y0, 0), min(y0 + i32(pool.kh), i32(pool.h)),
        max(x0, 0), min(x0 + i32(pool.kw), i32(pool.w)));
}

// The windows holding input pixel (iy, ix): rows [r.x, r.y), columns
// [r.z, r.w) of the output.
fn windows_over(iy: u32, ix: u32) -> vec4<u32> {
    let ty = i32(iy + pool.ph) - i32(pool.kh) + 1;
    let tx = i32(ix + pool.pw) - i32(pool.kw) + 1;
    let y_lo = select(0u, (u32(ty) + pool.sh - 1u) / pool.sh, ty > 0);
    let x_lo = select(0u, (u32(tx) + pool.sw - 1u) / pool.sw, tx > 0);
    let y_hi = min((iy + pool.ph) / pool.sh + 1u, pool.oh);
    let x_hi = min((ix + pool.pw) / pool.sw + 1u, pool.ow);
    return vec4<u32>(y_lo, y_hi, x_lo, x_hi);
}

// What an average divides by: the whole window, or its in-bounds taps.
fn divisor(oy: u32, ox: u32) -> f32 {
    if (pool.include_pad != 0u) { return f32(pool.kh * pool.kw); }
    let r = window(oy, ox);
    return f32(max((r.y - r.x) * (r.w - r.z), 1));
}

"#;

/// A window's maximum, for the kernels that read the input.
const BEST_OF: &str = r#"
// A window's maximum and its flat index in the plane: the first in
// row-major order, and once a NaN is met, that NaN.
struct Best { value: f32, at: u32 }

fn best_of(base: u32, oy: u32, ox: u32) -> Best {
    let r = window(oy, ox);
    var best = Best(-sc_inf(), 0xffffffffu);
    var first = true;
    for (var iy = r.x; iy < r.y; iy = iy + 1) {
        for (var ix = r.z; ix < r.w; ix = ix + 1) {
            let at = u32(iy) * pool.w + u32(ix);
            let v = input[base + at];
            if (first || (!sc_isnan(best.value) && (sc_isnan(v) || v > best.value))) {
                best = Best(v, at);
                first = false;
            }
        }
    }
    return best;
}
"#;

/// The WGSL of a pooling kernel. `params`: `[count, row_width, then`
/// [`pool_words`]`]`, `count` the outputs (forward, arg-max) or inputs
/// (gradients).
fn pool_shader(kernel: PoolKernel) -> String {
    let (bindings, body) = match kernel {
        PoolKernel::Max | PoolKernel::Average | PoolKernel::ArgMax => {
            let output = if kernel == PoolKernel::ArgMax {
                "u32"
            } else {
                "f32"
            };
            let result = match kernel {
                PoolKernel::Max => "best_of(base, oy, ox).value",
                PoolKernel::ArgMax => "best_of(base, oy, ox).at",
                _ => "average(base, oy, ox)",
            };
            (
                format!(
                    "@group(0) @binding(0) var<storage, read> input: array<f32>;\n\
                     @group(0) @binding(1) var<storage, read_write> output: array<{output}>;\n\
                     @group(0) @binding(2) var<storage, read> params: array<u32>;\n"
                ),
                format!(
                    r#"{BEST_OF}
fn average(base: u32, oy: u32, ox: u32) -> f32 {{
    let r = window(oy, ox);
    var sum = 0.0;
    for (var iy = r.x; iy < r.y; iy = iy + 1) {{
        for (var ix = r.z; ix < r.w; ix = ix + 1) {{
            sum = sum + input[base + u32(iy) * pool.w + u32(ix)];
        }}
    }}
    return sum / divisor(oy, ox);
}}

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    let i = id.x + id.y * params[1];
    if (i >= params[0]) {{ return; }}
    load_pool();
    let pixels = pool.oh * pool.ow;
    let base = (i / pixels) * pool.h * pool.w;
    let oy = (i % pixels) / pool.ow;
    let ox = i % pool.ow;
    output[i] = {result};
}}
"#
                ),
            )
        }
        PoolKernel::MaxGradient | PoolKernel::AverageGradient => {
            let (bindings, share) = if kernel == PoolKernel::MaxGradient {
                (
                    "@group(0) @binding(0) var<storage, read> arg_max: array<u32>;\n\
                     @group(0) @binding(1) var<storage, read> g: array<f32>;\n\
                     @group(0) @binding(2) var<storage, read_write> output: array<f32>;\n\
                     @group(0) @binding(3) var<storage, read> params: array<u32>;\n",
                    "if (arg_max[o] == at) { acc = acc + g[o]; }",
                )
            } else {
                (
                    "@group(0) @binding(0) var<storage, read> g: array<f32>;\n\
                     @group(0) @binding(1) var<storage, read_write> output: array<f32>;\n\
                     @group(0) @binding(2) var<storage, read> params: array<u32>;\n",
                    "acc = acc + g[o] / divisor(oy, ox);",
                )
            };
            (
                bindings.to_string(),
                format!(
                    r#"
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    let i = id.x + id.y * params[1];
    if (i >= params[0]) {{ return; }}
    load_pool();
    let plane = i / (pool.h * pool.w);
    let at = i % (pool.h * pool.w);
    let r = windows_over(at / pool.w, at % pool.w);
    let base = plane * pool.oh * pool.ow;
    var acc = 0.0;
    for (var oy = r.x; oy < r.y; oy = oy + 1u) {{
        for (var ox = r.z; ox < r.w; ox = ox + 1u) {{
            let o = base + oy * pool.ow + ox;
            {share}
        }}
    }}
    output[i] = acc;
}}
"#
                ),
            )
        }
    };
    format!("{PRELUDE}{bindings}{POOL_HEAD}{body}")
}

/// One pooling launch over `count` threads (the elements of `out`) with
/// `buffers` then the new output bound in order.
fn pool_launch(
    gpu: &'static Gpu,
    source: &str,
    buffers: &[&DeviceTensor],
    out: &TensorMetadata,
    words: [u32; 11],
) -> Result<Outputs> {
    let count = out.shape.numel() as u32;
    let pipeline = gpu.pipeline(source)?;
    let y = gpu.alloc(out.clone())?;
    let (gx, gy) = grid(count.div_ceil(WORKGROUP));
    let mut params = vec![count, gx * WORKGROUP];
    params.extend(words);
    let mut bound: Vec<&DeviceTensor> = buffers.to_vec();
    bound.push(&y);
    launch(gpu, &pipeline, &bound, &params, (gx, gy, 1))?;
    drop(bound);
    Ok(one(y))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shader this module generates, for the test that compiles them.
    fn every_shader() -> Vec<(String, String)> {
        let mut sources = Vec::new();
        for product in [
            Product::Forward,
            Product::InputGradient,
            Product::FilterGradient,
        ] {
            for tiling in [
                Tiling::Direct,
                Tiling::Tiled { rows: 1 },
                Tiling::Tiled { rows: 2 },
                Tiling::Tiled { rows: 4 },
            ] {
                sources.push((
                    format!("{product:?} {tiling:?}"),
                    gemm_shader(product, tiling),
                ));
            }
        }
        sources.push(("split sum".into(), shader::part_sums()));
        for kernel in [
            PoolKernel::Max,
            PoolKernel::Average,
            PoolKernel::ArgMax,
            PoolKernel::MaxGradient,
            PoolKernel::AverageGradient,
        ] {
            sources.push((format!("{kernel:?}"), pool_shader(kernel)));
        }
        sources
    }

    #[test]
    fn every_conv_and_pool_shader_compiles() {
        let gpu = Gpu::get(0).unwrap_or_else(|e| panic!("the GPU tests need gpu:0: {e}"));
        let shaders = every_shader();
        for (name, source) in &shaders {
            gpu.pipeline(source)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        assert_eq!(shaders.len(), 18);
    }
}
