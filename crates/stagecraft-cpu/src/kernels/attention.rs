//! Scaled dot-product attention, fused and tiled: the forward pass in
//! FlashAttention's scheme and the backward in FlashAttention-2's. Neither
//! forms the `T × S` matrix of scores; each holds one block of it at a
//! time, so the memory beyond inputs and outputs is a few blocks per
//! thread (see [`workspace_bytes`]), not `O(T·S)`.
//!
//! **Layouts.** Work is cut by *unit*: the heads whose rows interleave in
//! memory, one head in the `"bhtd"` layout, a batch element's `H` heads in
//! `"bthd"` (where a head's rows are `H·D` apart). A task runs its unit's
//! heads one after another on the same rows, so it owns whole rows of
//! every output; each head's arithmetic is the same in both layouts.
//!
//! **Forward**, one task per (unit, block of [`BLOCK_Q`] queries): the
//! block's queries are copied transposed and multiplied by the scale
//! (`qt`), then for each block of [`BLOCK_K`] keys the scores come out
//! transposed, `Sᵀ = K_j · qt` (keys × queries, so that every per-query
//! quantity below runs along vector lanes), the running maximum `m`,
//! running sum `l` and output rows `O` are rescaled by `exp(m_old − m)`
//! (the online softmax), `P = exp(S − m)` replaces the scores in place,
//! and `O += P·V_j` reads `P` from its transposed block. At the end
//! `O /= l` and `L = m + ln l`. With causal
//! masking the key blocks past the block's last query are skipped, and in
//! the block on the diagonal the masked scores are `-∞` before the maximum
//! and exact zeros after the exponential. Of that block, the quadrant of
//! its first [`SPLIT`] queries against its later keys is masked whole and
//! not computed at all, in either pass ([`causal_gemm`]): at the GPT
//! step's `T = 64`, a quarter of the products.
//!
//! **Backward**, one task per (unit, group of key blocks): `Δ = rowsum(dO ∘
//! O)` first, then for each key block `j` of the group, over the query
//! blocks that see it, `S = Q_i · (scale·K_j)ᵀ`, `P = exp(S − L_i)`,
//! `dV_j += Pᵀ·dO_i`, `dP = dO_i·V_jᵀ`, `dS = scale·P ∘ (dP − Δ_i)`, `dQ_i
//! += dS·K_j` and `dK_j += dSᵀ·Q_i`. A key block's `dK` and `dV` rows
//! belong to its task alone. `dQ` rows receive from every key block: a
//! head's groups are fixed by the shape ([`key_groups`]), the first group
//! accumulates into `dQ` itself and the others into buffers of their own,
//! added in group order at the end, so the result has the same bits on
//! any number of threads (one group per head whenever there are enough
//! heads to keep the threads busy, so nothing is added at all).
//!
//! **Block products** are register tiles of [`ROWS`] rows by `W` columns
//! (64 f32 columns with AVX-512: 16 accumulators of 16 lanes), each step
//! broadcasting one value of `A` per row against one row of `B` read into
//! registers once: measured on one Zen 4 core, 64×64×64 products run at
//! 115 GFLOP/s, the core's FMA peak (the project's `sgemm` runs the same
//! blocks at 110, and writes its product where these passes add to one);
//! the same loop letting each FMA read its `B` operand from memory again
//! (what the compiler chose when the row was not copied to a local first)
//! ran at 65, held back by the loads. The loops are plain Rust, compiled
//! three times (x86-64 baseline, AVX2 with FMA, AVX-512) and chosen once at
//! run time, like the fused elementwise kernels; they also serve f64,
//! which `sgemm` does not. f16 and bf16 compute in f32.
//!
//! **exp**: f32 uses its own branch-free exponential (Cody–Waite reduction
//! and a degree-7 polynomial, within 2 ulp on the arguments attention
//! forms, which are never positive), so that the softmax loops vectorize;
//! f64 uses `scalar::exp_to_narrow` (within 1e-15). Both give exactly 0
//! for `-∞`, and terms below `e⁻⁸⁷` (f32) or `e⁻¹¹⁰` (f64) of a row's
//! largest are dropped (they are below the sum's rounding error).

use crate::kernel::{Kernel, KernelContext, KernelRegistry, Outputs};
use crate::Inputs;
use half::{bf16, f16};
use smallvec::smallvec;
use stagecraft_ops::{attention_geometry, AttentionGeometry, Attrs};
use stagecraft_tensor::{DType, DenseHostTensor, Error, Result, TensorMetadata};
use std::ops::{Add, Div, Mul, Range, Sub};
use std::sync::Arc;

pub(crate) fn register(registry: &mut KernelRegistry) {
    registry.add(
        &stagecraft_ops::SCALED_DOT_PRODUCT_ATTENTION,
        forward_factory,
    );
    registry.add(
        &stagecraft_ops::SCALED_DOT_PRODUCT_ATTENTION_GRAD,
        backward_factory,
    );
}

/// Queries per block: the lanes of the forward pass's per-query vectors
/// (four AVX-512 f32 vectors), and the rows of the backward's blocks.
pub const BLOCK_Q: usize = 64;

/// Keys per block. A 64 × 64 f32 block of scores is 16 KiB: the block, the
/// transposed queries (or keys) and the rows of the other operand stay in
/// a core's L1 and L2 while a block pair is multiplied.
pub const BLOCK_K: usize = 64;

/// Where the block on a causal diagonal (its first key is its first
/// query) is cut: the queries before it see none of the keys from it on,
/// so of the block's four quadrants that one is skipped, a quarter of its
/// products (see [`causal_gemm`]).
const SPLIT: usize = BLOCK_Q / 2;
const _: () = assert!(SPLIT.is_multiple_of(LANES) && BLOCK_K == BLOCK_Q);

/// Rows of a register tile (see the module documentation).
const ROWS: usize = 4;

/// Queries whose softmax statistics the forward pass keeps in registers
/// at a time (one AVX-512 vector of f32); a block is a whole number of
/// them.
const LANES: usize = 16;
const _: () = assert!(BLOCK_Q.is_multiple_of(LANES));

/// With fewer heads than this, the backward pass splits each head's key
/// blocks into groups (at most this many tasks per head in all), so that
/// a single long sequence still spreads over the threads. A constant, so
/// that the split depends on the shape alone.
const BACKWARD_TASKS: usize = 8;

/// Attention with fewer multiply-adds than this runs on the calling
/// thread (the GEMM's threshold for splitting a product).
const PARALLEL_WORK: usize = 64 * 64 * 64;

// ---------------------------------------------------------------------------
// Element types and instruction sets.

/// f32 and f64, the types attention computes in.
pub(crate) trait Float:
    Copy
    + Default
    + PartialEq
    + PartialOrd
    + Send
    + Sync
    + std::fmt::Debug
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    fn from_f64(x: f64) -> Self;
    /// The larger of two values, compiled to one vector maximum.
    #[inline(always)]
    fn larger(self, other: Self) -> Self {
        if self > other {
            self
        } else {
            other
        }
    }
    /// `self·a + b`, fused where the instruction set has FMA.
    #[inline(always)]
    fn mul_plus<I: Isa>(self, a: Self, b: Self) -> Self {
        if I::FMA {
            self.fused_mul_add(a, b)
        } else {
            self * a + b
        }
    }
    fn fused_mul_add(self, a: Self, b: Self) -> Self;
    /// `e^self` for the arguments attention forms (see the module
    /// documentation): vectorizable, exactly 0 for `-∞`, NaN for NaN.
    fn exp<I: Isa>(self) -> Self;
    fn ln(self) -> Self;
    /// The block product of `p` into `c`, with `I`'s tile widths for this
    /// type.
    fn gemm<I: Isa>(p: &Product<'_, Self>, c: &mut [Self], ldc: usize, accumulate: bool);
}

impl Float for f32 {
    const ZERO: f32 = 0.0;
    const ONE: f32 = 1.0;
    const NEG_INFINITY: f32 = f32::NEG_INFINITY;
    #[inline(always)]
    fn from_f64(x: f64) -> f32 {
        x as f32
    }
    #[inline(always)]
    fn fused_mul_add(self, a: f32, b: f32) -> f32 {
        self.mul_add(a, b)
    }
    #[inline(always)]
    fn exp<I: Isa>(self) -> f32 {
        exp_f32::<I>(self)
    }
    #[inline(always)]
    fn ln(self) -> f32 {
        f32::ln(self)
    }
    #[inline(always)]
    fn gemm<I: Isa>(p: &Product<'_, f32>, c: &mut [f32], ldc: usize, accumulate: bool) {
        <I::F32 as Widths>::gemm::<f32, I>(p, c, ldc, accumulate)
    }
}

impl Float for f64 {
    const ZERO: f64 = 0.0;
    const ONE: f64 = 1.0;
    const NEG_INFINITY: f64 = f64::NEG_INFINITY;
    #[inline(always)]
    fn from_f64(x: f64) -> f64 {
        x
    }
    #[inline(always)]
    fn fused_mul_add(self, a: f64, b: f64) -> f64 {
        self.mul_add(a, b)
    }
    #[inline(always)]
    fn exp<I: Isa>(self) -> f64 {
        // Below e^-110 `exp_to_narrow` clamps; such terms are 1e-48 of the
        // largest one in their row, so they are dropped.
        if self < -110.0 {
            0.0
        } else {
            stagecraft_ops::scalar::exp_to_narrow(self)
        }
    }
    #[inline(always)]
    fn ln(self) -> f64 {
        f64::ln(self)
    }
    #[inline(always)]
    fn gemm<I: Isa>(p: &Product<'_, f64>, c: &mut [f64], ldc: usize, accumulate: bool) {
        <I::F64 as Widths>::gemm::<f64, I>(p, c, ldc, accumulate)
    }
}

/// `e^x` in f32 without a call: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2`
/// (Cody–Waite: `n · LN2_HI` is exact), `e^r` as its Taylor polynomial to
/// degree 7 (truncation below 6e-9, a tenth of an ulp), `2^n` from its
/// bits. Arguments below `LOW` give 0 (their exponential is not a normal
/// f32); above `HIGH`, the value at `HIGH` (attention never exponentiates
/// a positive number: every argument is a score minus a maximum or a
/// log-sum-exp at least as large).
#[inline(always)]
fn exp_f32<I: Isa>(x: f32) -> f32 {
    // 1.5 · 2^23: adding it rounds to an integer, in the low mantissa bits.
    const ROUNDER: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // e^LOW is about the smallest normal f32, 2^-126.
    const LOW: f32 = -87.336_55;
    // Rounds to n = 127 at most, whose 2^n is still finite.
    const HIGH: f32 = 88.0;
    const COEFFICIENTS: [f32; 8] = [
        1.0,
        1.0,
        1.0 / 2.0,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5040.0,
    ];
    // NaN stays NaN.
    let c = x.clamp(LOW, HIGH);
    let shifted = c.mul_plus::<I>(std::f32::consts::LOG2_E, ROUNDER);
    let n = shifted - ROUNDER;
    let r = n.mul_plus::<I>(-LN2_HI, c);
    let r = n.mul_plus::<I>(-LN2_LO, r);
    let mut p = COEFFICIENTS[7];
    for k in (0..7).rev() {
        p = p.mul_plus::<I>(r, COEFFICIENTS[k]);
    }
    // `shifted`'s low bits hold n, in -126..=127 (two's complement), so
    // n + 127 in the exponent field is 2^n. Integer operations only: a
    // float-to-integer conversion (which Rust saturates, NaN to 0) kept
    // the loop from vectorizing. For NaN, p is NaN whatever the scale.
    let scale = f32::from_bits(shifted.to_bits().wrapping_add(127) << 23);
    if x < LOW {
        0.0
    } else {
        p * scale
    }
}

/// An instruction set the loops are compiled for: whether it fuses
/// multiply-adds, and the widths of its register tiles for each type.
pub(crate) trait Isa {
    const FMA: bool;
    type F32: Widths;
    type F64: Widths;
    /// [`block_gemm`] compiled for this instruction set, as a function of
    /// its own.
    fn gemm<T: Float, const W: usize, const H: usize>(
        p: &Product<'_, T>,
        c: &mut [T],
        ldc: usize,
        accumulate: bool,
    );
}

/// x86-64's baseline (SSE2): 4-lane f32 vectors, no FMA.
pub(crate) struct Baseline;
impl Isa for Baseline {
    const FMA: bool = false;
    type F32 = Pair<8, 4>;
    type F64 = Pair<4, 2>;
    fn gemm<T: Float, const W: usize, const H: usize>(
        p: &Product<'_, T>,
        c: &mut [T],
        ldc: usize,
        accumulate: bool,
    ) {
        block_gemm::<T, Baseline, W, H>(p, c, ldc, accumulate)
    }
}

/// AVX2 with FMA: 16 registers of 8 f32 lanes; a 4 × 16 tile takes 8
/// accumulators, the `B` row 2 more. Named only by code that runs after
/// [`level`] found AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx2;
#[cfg(target_arch = "x86_64")]
impl Isa for Avx2 {
    const FMA: bool = true;
    type F32 = Pair<16, 8>;
    type F64 = Pair<8, 4>;
    #[inline(always)]
    fn gemm<T: Float, const W: usize, const H: usize>(
        p: &Product<'_, T>,
        c: &mut [T],
        ldc: usize,
        accumulate: bool,
    ) {
        // SAFETY: `Avx2` is named only by the functions `forward_block_on`
        // and `backward_task_on` call on a CPU where `level()` found AVX2
        // and FMA.
        unsafe { gemm_avx2::<T, W, H>(p, c, ldc, accumulate) }
    }
}

/// AVX-512: 32 registers of 16 f32 lanes; a 4 × 64 tile takes 16
/// accumulators and 4 for the `B` row. Named only by code that runs after
/// [`level`] found AVX-512F.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx512;
#[cfg(target_arch = "x86_64")]
impl Isa for Avx512 {
    const FMA: bool = true;
    type F32 = Pair<64, 32>;
    type F64 = Pair<32, 16>;
    #[inline(always)]
    fn gemm<T: Float, const W: usize, const H: usize>(
        p: &Product<'_, T>,
        c: &mut [T],
        ldc: usize,
        accumulate: bool,
    ) {
        // SAFETY: as for `Avx2`, with AVX-512F.
        unsafe { gemm_avx512::<T, W, H>(p, c, ldc, accumulate) }
    }
}

// The block products are functions of their own, not inlined into the
// passes that call them: inlined there, into functions thousands of
// instructions long, the compiler kept some of a tile's accumulators in
// memory and stored them at every step (the forward pass's products ran
// at 40 % of their speed alone); on their own they run at the core's peak.

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline(never)]
fn gemm_avx2<T: Float, const W: usize, const H: usize>(
    p: &Product<'_, T>,
    c: &mut [T],
    ldc: usize,
    accumulate: bool,
) {
    block_gemm::<T, Avx2, W, H>(p, c, ldc, accumulate)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline(never)]
fn gemm_avx512<T: Float, const W: usize, const H: usize>(
    p: &Product<'_, T>,
    c: &mut [T],
    ldc: usize,
    accumulate: bool,
) {
    block_gemm::<T, Avx512, W, H>(p, c, ldc, accumulate)
}

/// The tile widths of one type on one instruction set: `W` columns, or
/// `H` for what is left of a product when `H` columns cover it.
pub(crate) struct Pair<const W: usize, const H: usize>;

pub(crate) trait Widths {
    fn gemm<T: Float, I: Isa>(p: &Product<'_, T>, c: &mut [T], ldc: usize, accumulate: bool);
}

impl<const W: usize, const H: usize> Widths for Pair<W, H> {
    #[inline(always)]
    fn gemm<T: Float, I: Isa>(p: &Product<'_, T>, c: &mut [T], ldc: usize, accumulate: bool) {
        I::gemm::<T, W, H>(p, c, ldc, accumulate)
    }
}

/// The instruction sets this build can run the loops with, from the
/// baseline up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// The level the loops run with: [`crate::isa::level`], the CPU's unless
/// `STAGECRAFT_CPU_ISA` lowers it.
pub(crate) fn level() -> Level {
    match crate::isa::level() {
        #[cfg(target_arch = "x86_64")]
        crate::isa::IsaLevel::Avx512 => Level::Avx512,
        #[cfg(target_arch = "x86_64")]
        crate::isa::IsaLevel::Avx2 => Level::Avx2,
        _ => Level::Baseline,
    }
}

// ---------------------------------------------------------------------------
// Block products.

/// How the left operand `A` (`m × k`) of a block product is stored.
#[derive(Clone, Copy)]
pub(crate) enum Layout {
    /// Row-major, rows this far apart: element `(i, p)` at `i·ld + p`.
    Rows(usize),
    /// Transposed, columns this far apart: element `(i, p)` at `p·ld + i`
    /// (a block of scores read as its transpose).
    Columns(usize),
}

/// `A · B` for a block product: `A` is `m × k`, stored as `a_layout` says;
/// `B` is `k × n` row-major, rows `ldb` apart, of which `readable` columns
/// (at least `n`) may be read (a zero-padded block lets the last tile read
/// whole rows).
pub(crate) struct Product<'a, T> {
    m: usize,
    n: usize,
    k: usize,
    a: &'a [T],
    a_layout: Layout,
    b: &'a [T],
    ldb: usize,
    readable: usize,
}

/// `c (+)= A·B` (`c` row-major, rows `ldc` apart), in tiles of [`ROWS`]
/// rows by `W` columns, or `H` where `H` covers the last columns.
#[inline(always)]
fn block_gemm<T: Float, I: Isa, const W: usize, const H: usize>(
    p: &Product<'_, T>,
    c: &mut [T],
    ldc: usize,
    accumulate: bool,
) {
    if p.k == 0 {
        // An empty sum: `B` may have no rows at all.
        if !accumulate {
            for i in 0..p.m {
                c[i * ldc..i * ldc + p.n].fill(T::ZERO);
            }
        }
        return;
    }
    let mut j0 = 0;
    while j0 < p.n {
        let cols = (p.n - j0).min(W);
        let readable = p.readable - j0;
        let (b, c) = (&p.b[j0..], &mut c[j0..]);
        if cols > H {
            tile_rows::<T, I, W>(p, b, readable, c, ldc, cols, accumulate);
        } else {
            tile_rows::<T, I, H>(p, b, readable, c, ldc, cols, accumulate);
        }
        j0 += cols;
    }
}

impl<'a, T> Product<'a, T> {
    /// The product of `A`'s `rows` and `B`'s `cols` over the `inner`
    /// range of their shared dimension; its output starts at row
    /// `rows.start`, column `cols.start` of the whole one's.
    fn part(&self, rows: Range<usize>, cols: Range<usize>, inner: Range<usize>) -> Product<'a, T> {
        let a = match self.a_layout {
            Layout::Rows(ld) => &self.a[rows.start * ld + inner.start..],
            Layout::Columns(ld) => &self.a[inner.start * ld + rows.start..],
        };
        Product {
            m: rows.len(),
            n: cols.len(),
            k: inner.len(),
            a,
            a_layout: self.a_layout,
            b: &self.b[inner.start * self.ldb + cols.start..],
            ldb: self.ldb,
            readable: self.readable - cols.start,
        }
    }
}

/// What a block product's rows run over, on the diagonal of a causal
/// attention, and where the other side of the mask lies: along its
/// columns or along the dimension it sums over.
#[derive(Clone, Copy)]
enum Diagonal {
    /// Rows are queries; keys are the columns.
    QueriesByKeyColumns,
    /// Rows are queries; the product sums over keys.
    QueriesOverKeys,
    /// Rows are keys; queries are the columns.
    KeysByQueryColumns,
    /// Rows are keys; the product sums over queries.
    KeysOverQueries,
}

/// `c (+)= A·B`; for a block `on_diagonal` of a causal attention (more
/// than [`SPLIT`] queries and keys), without the quadrant of the queries
/// before `SPLIT` against the keys from `SPLIT` on, none of whose scores
/// is seen (where `A` or `B` holds probabilities, they are zeros there;
/// where they are the scores, they are never read). That quadrant of the
/// output is left as it was.
#[inline(always)]
fn causal_gemm<T: Float, I: Isa>(
    p: &Product<'_, T>,
    c: &mut [T],
    ldc: usize,
    accumulate: bool,
    (on_diagonal, roles): (bool, Diagonal),
) {
    if !on_diagonal {
        return T::gemm::<I>(p, c, ldc, accumulate);
    }
    let (m, n, k) = (p.m, p.n, p.k);
    // The two parts as (rows, columns, inner).
    let parts = match roles {
        // The earlier queries against the earlier keys, the later ones
        // against all.
        Diagonal::QueriesByKeyColumns => [(0..SPLIT, 0..SPLIT, 0..k), (SPLIT..m, 0..n, 0..k)],
        Diagonal::QueriesOverKeys => [(0..SPLIT, 0..n, 0..SPLIT), (SPLIT..m, 0..n, 0..k)],
        // The earlier keys against all queries, the later ones against
        // the later queries.
        Diagonal::KeysByQueryColumns => [(0..SPLIT, 0..n, 0..k), (SPLIT..m, SPLIT..n, 0..k)],
        Diagonal::KeysOverQueries => [(0..SPLIT, 0..n, 0..k), (SPLIT..m, 0..n, SPLIT..k)],
    };
    for (rows, cols, inner) in parts {
        let at = rows.start * ldc + cols.start;
        T::gemm::<I>(&p.part(rows, cols, inner), &mut c[at..], ldc, accumulate);
    }
}

/// Every row of the product against `cols` columns from `b` on.
#[inline(always)]
fn tile_rows<T: Float, I: Isa, const W: usize>(
    p: &Product<'_, T>,
    b: &[T],
    readable: usize,
    c: &mut [T],
    ldc: usize,
    cols: usize,
    accumulate: bool,
) {
    let mut i0 = 0;
    while i0 < p.m {
        let rows = (p.m - i0).min(ROWS);
        let a = match p.a_layout {
            Layout::Rows(ld) => &p.a[i0 * ld..],
            Layout::Columns(_) => &p.a[i0..],
        };
        let c = &mut c[i0 * ldc..];
        let tile = Tile {
            k: p.k,
            a,
            a_layout: p.a_layout,
            b,
            ldb: p.ldb,
            readable,
        };
        match rows {
            4 => tile.run::<I, 4, W>(c, ldc, cols, accumulate),
            3 => tile.run::<I, 3, W>(c, ldc, cols, accumulate),
            2 => tile.run::<I, 2, W>(c, ldc, cols, accumulate),
            _ => tile.run::<I, 1, W>(c, ldc, cols, accumulate),
        }
        i0 += rows;
    }
}

/// One register tile's operands (`k` ≥ 1).
struct Tile<'a, T> {
    k: usize,
    a: &'a [T],
    a_layout: Layout,
    b: &'a [T],
    ldb: usize,
    readable: usize,
}

impl<T: Float> Tile<'_, T> {
    /// `c[R × cols] (+)= a[R × k] · b[k × cols]`, the product held in
    /// `R × W` accumulators.
    #[inline(always)]
    fn run<I: Isa, const R: usize, const W: usize>(
        &self,
        c: &mut [T],
        ldc: usize,
        cols: usize,
        accumulate: bool,
    ) {
        // Each step reads `A` within bounds checked once, here, so that
        // the loop has no exit between its multiply-adds: with a bounds
        // check per value, the compiler kept some accumulators in memory,
        // stored at every step (the backward pass ran at 62 % of the
        // products' speed).
        let acc: [[T; W]; R] = match self.a_layout {
            Layout::Rows(ld) => {
                let rows: [&[T]; R] = std::array::from_fn(|i| &self.a[i * ld..i * ld + self.k]);
                self.sweep::<I, R, W>(cols, |p| std::array::from_fn(|i| rows[i][p]))
            }
            Layout::Columns(ld) => {
                let a = &self.a[..(self.k - 1) * ld + R];
                self.sweep::<I, R, W>(cols, |p| {
                    *<&[T; R]>::try_from(&a[p * ld..p * ld + R]).expect("a slice of R values")
                })
            }
        };
        // Only constant indices into `acc`, so that it lives in registers:
        // slicing it to `cols` kept it in memory, stored at every step of
        // the loop (3× slower), and copying a row of it out went through
        // the stack (10 % slower).
        for i in 0..R {
            if cols == W {
                let out = <&mut [T; W]>::try_from(&mut c[i * ldc..i * ldc + W])
                    .expect("a slice of W values");
                if accumulate {
                    for j in 0..W {
                        out[j] = out[j] + acc[i][j];
                    }
                } else {
                    out.copy_from_slice(&acc[i]);
                }
            } else {
                // A copy, indexed up to `cols`: `acc` itself keeps
                // constant indices.
                let sums: [T; W] = acc[i];
                let out = &mut c[i * ldc..i * ldc + cols];
                for (o, &x) in out.iter_mut().zip(&sums) {
                    *o = if accumulate { *o + x } else { x };
                }
            }
        }
    }

    /// `Σₚ column(p) ⊗ b[p]` over the `k` steps, in accumulators local to
    /// the loop (returned by value, they stay in registers).
    #[inline(always)]
    fn sweep<I: Isa, const R: usize, const W: usize>(
        &self,
        cols: usize,
        column: impl Fn(usize) -> [T; R],
    ) -> [[T; W]; R] {
        let mut acc = [[T::ZERO; W]; R];
        if self.readable >= W {
            for p in 0..self.k {
                // Copied into a local first: the row then stays in
                // registers for the R rows' multiply-adds instead of being
                // read from memory by each of them (65 → 116 GFLOP/s).
                let row: [T; W] = *<&[T; W]>::try_from(&self.b[p * self.ldb..p * self.ldb + W])
                    .expect("a slice of W values");
                let x = column(p);
                for i in 0..R {
                    for j in 0..W {
                        acc[i][j] = x[i].mul_plus::<I>(row[j], acc[i][j]);
                    }
                }
            }
        } else {
            // The last columns of an operand that has no W readable: the
            // missing ones are zeros, and never stored.
            for p in 0..self.k {
                let mut row = [T::ZERO; W];
                row[..cols].copy_from_slice(&self.b[p * self.ldb..p * self.ldb + cols]);
                let x = column(p);
                for i in 0..R {
                    for j in 0..W {
                        acc[i][j] = x[i].mul_plus::<I>(row[j], acc[i][j]);
                    }
                }
            }
        }
        acc
    }
}

// ---------------------------------------------------------------------------
// Forward.

/// One head's inputs, each from the head's first row on; row `i` of `q`
/// starts at `i·ld_qk` (and of `k` too), of `v` at `i·ld_v`.
#[derive(Clone, Copy)]
struct Head<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    ld_qk: usize,
    ld_v: usize,
}

/// Where head `head`'s first row of a `[.., rows, width]` operand starts.
fn first_row(g: &AttentionGeometry, head: usize, rows: usize, width: usize) -> usize {
    g.row(head, rows, 0) * width
}

/// `x` from `start` on, empty when `start` is past its end (a head's
/// first row of an operand with no rows, `S = 0`, or no columns).
fn tail<T>(x: &[T], start: usize) -> &[T] {
    x.get(start..).unwrap_or_default()
}

/// The row strides of the `q`/`k` and the `v`/`O` operands.
fn strides(g: &AttentionGeometry) -> (usize, usize) {
    (g.interleaved * g.d, g.interleaved * g.dv)
}

/// What a thread of the forward pass works in, reused across its tasks.
struct ForwardScratch<T> {
    /// A block's queries, transposed and scaled: `qt[c·BLOCK_Q + i]` is
    /// `q[i][c]·scale`, zero past the block's queries.
    qt: Vec<T>,
    /// A block of scores transposed (keys × queries), then of
    /// probabilities.
    st: Vec<T>,
    /// Per query: running maximum, running sum, and the factor that
    /// rescales them and its output row for a new maximum.
    max: [T; BLOCK_Q],
    sum: [T; BLOCK_Q],
    alpha: [T; BLOCK_Q],
}

impl<T: Float> ForwardScratch<T> {
    fn new(g: &AttentionGeometry) -> ForwardScratch<T> {
        ForwardScratch {
            qt: vec![T::ZERO; g.d * BLOCK_Q],
            st: vec![T::ZERO; BLOCK_K * BLOCK_Q],
            max: [T::ZERO; BLOCK_Q],
            sum: [T::ZERO; BLOCK_Q],
            alpha: [T::ZERO; BLOCK_Q],
        }
    }
}

/// A block of queries of a unit (the heads whose rows interleave: one
/// head, or with the `"bthd"` layout every head of a batch element): its
/// first query, and the unit's rows of `O` and `L` for the block.
struct QueryBlock<'a, T> {
    unit: usize,
    first: usize,
    rows: usize,
    o: &'a mut [T],
    lse: &'a mut [T],
}

/// One head's rows of a [`QueryBlock`]: `O`'s rows `ld_o` apart and `L`'s
/// `ld_l` apart.
struct HeadRows<'a, T> {
    first: usize,
    rows: usize,
    o: &'a mut [T],
    lse: &'a mut [T],
    ld_o: usize,
    ld_l: usize,
}

/// One block of queries against every key it sees (see the module
/// documentation).
#[inline(always)]
fn forward_block<T: Float, I: Isa>(
    g: &AttentionGeometry,
    head: Head<'_, T>,
    block: HeadRows<'_, T>,
    scratch: &mut ForwardScratch<T>,
) {
    let (d, dv) = (g.d, g.dv);
    let (i0, br) = (block.first, block.rows);
    let scale = T::from_f64(g.scale);
    let ForwardScratch {
        qt,
        st,
        max,
        sum,
        alpha,
    } = scratch;
    for c in 0..d {
        let lane = &mut qt[c * BLOCK_Q..(c + 1) * BLOCK_Q];
        for (ii, x) in lane[..br].iter_mut().enumerate() {
            *x = head.q[(i0 + ii) * head.ld_qk + c] * scale;
        }
        lane[br..].fill(T::ZERO);
    }
    max.fill(T::NEG_INFINITY);
    sum.fill(T::ZERO);
    let (o, ld_o) = (block.o, block.ld_o);
    for ii in 0..br {
        o[ii * ld_o..ii * ld_o + dv].fill(T::ZERO);
    }
    // With causal masking, keys past the block's last query are masked
    // for all of its queries.
    let key_end = if g.causal { g.s.min(i0 + br) } else { g.s };
    let mut j0 = 0;
    while j0 < key_end {
        let bc = BLOCK_K.min(key_end - j0);
        // The causal diagonal (blocks start at multiples of both sizes,
        // so only `j0 == i0` is masked in part, and then `bc <= br`).
        let diagonal = g.causal && j0 == i0 && bc > SPLIT;
        let scores = Product {
            m: bc,
            n: br,
            k: d,
            a: &head.k[j0 * head.ld_qk..],
            a_layout: Layout::Rows(head.ld_qk),
            b: qt,
            ldb: BLOCK_Q,
            readable: BLOCK_Q,
        };
        causal_gemm::<T, I>(
            &scores,
            st,
            BLOCK_Q,
            false,
            (diagonal, Diagonal::KeysByQueryColumns),
        );
        // Key j is masked for the queries before it: lanes `..j - i0`.
        let hidden = |jj: usize| {
            if g.causal {
                (j0 + jj).saturating_sub(i0).min(br)
            } else {
                0
            }
        };
        // Masked scores become -∞, so that the maximum skips them and
        // their exponentials are exact zeros: only the rows of keys past
        // the block's first query have any.
        for jj in 0..bc {
            let hidden = hidden(jj);
            st[jj * BLOCK_Q..jj * BLOCK_Q + hidden].fill(T::NEG_INFINITY);
        }
        // A chunk of LANES queries (a vector or two) at a time, so that
        // its running maximum and sum stay in registers over the block's
        // keys (kept in arrays, they were loaded and stored at every key).
        // Lanes past `br` compute on stale scores and are never read, and
        // on the diagonal the queries before `SPLIT` stop at its keys.
        for c0 in (0..br).step_by(LANES) {
            let at = |jj: usize| jj * BLOCK_Q + c0..jj * BLOCK_Q + c0 + LANES;
            let keys = if diagonal && c0 < SPLIT { SPLIT } else { bc };
            let mut block_max = [T::NEG_INFINITY; LANES];
            for jj in 0..keys {
                let row = <&[T; LANES]>::try_from(&st[at(jj)]).expect("LANES scores");
                for (m, &x) in block_max.iter_mut().zip(row) {
                    *m = m.larger(x);
                }
            }
            let mut shift = [T::ZERO; LANES];
            for l in 0..LANES {
                let q = c0 + l;
                let new = max[q].larger(block_max[l]);
                // A query none of whose keys so far has a finite score
                // keeps a zero sum (and `exp(-∞ - -∞)` would be NaN).
                let base = if new == T::NEG_INFINITY { T::ZERO } else { new };
                alpha[q] = (max[q] - base).exp::<I>();
                max[q] = new;
                shift[l] = base;
            }
            let mut block_sum = [T::ZERO; LANES];
            for jj in 0..keys {
                let row = <&mut [T; LANES]>::try_from(&mut st[at(jj)]).expect("LANES scores");
                for ((x, &base), s) in row.iter_mut().zip(&shift).zip(block_sum.iter_mut()) {
                    let p = (*x - base).exp::<I>();
                    *x = p;
                    *s = *s + p;
                }
            }
            for (l, &block) in block_sum.iter().enumerate() {
                let q = c0 + l;
                sum[q] = sum[q].mul_plus::<I>(alpha[q], block);
            }
        }
        for (ii, &a) in alpha[..br].iter().enumerate() {
            if a != T::ONE {
                for x in o[ii * ld_o..ii * ld_o + dv].iter_mut() {
                    *x = *x * a;
                }
            }
        }
        let values = Product {
            m: br,
            n: dv,
            k: bc,
            a: st,
            a_layout: Layout::Columns(BLOCK_Q),
            b: &head.v[j0 * head.ld_v..],
            ldb: head.ld_v,
            readable: dv,
        };
        causal_gemm::<T, I>(
            &values,
            o,
            ld_o,
            true,
            (diagonal, Diagonal::QueriesOverKeys),
        );
        j0 += bc;
    }
    for ii in 0..br {
        let row = &mut o[ii * ld_o..ii * ld_o + dv];
        let lse = &mut block.lse[ii * block.ld_l];
        if sum[ii] == T::ZERO {
            // No keys (S = 0): an empty sum of weighted values.
            row.fill(T::ZERO);
            *lse = T::NEG_INFINITY;
        } else {
            let inverse = T::ONE / sum[ii];
            for x in row.iter_mut() {
                *x = *x * inverse;
            }
            *lse = max[ii] + sum[ii].ln();
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn forward_block_avx2<T: Float>(
    g: &AttentionGeometry,
    head: Head<'_, T>,
    block: HeadRows<'_, T>,
    scratch: &mut ForwardScratch<T>,
) {
    forward_block::<T, Avx2>(g, head, block, scratch)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn forward_block_avx512<T: Float>(
    g: &AttentionGeometry,
    head: Head<'_, T>,
    block: HeadRows<'_, T>,
    scratch: &mut ForwardScratch<T>,
) {
    forward_block::<T, Avx512>(g, head, block, scratch)
}

fn forward_block_on<T: Float>(
    level: Level,
    g: &AttentionGeometry,
    head: Head<'_, T>,
    block: HeadRows<'_, T>,
    scratch: &mut ForwardScratch<T>,
) {
    match level {
        Level::Baseline => forward_block::<T, Baseline>(g, head, block, scratch),
        // SAFETY: `level` is at most what `level()` detected on this CPU,
        // which has AVX2 and FMA, all `forward_block_avx2` is compiled to
        // use.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { forward_block_avx2(g, head, block, scratch) },
        // SAFETY: as above, with AVX-512F.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { forward_block_avx512(g, head, block, scratch) },
    }
}

/// `x` cut into `count` consecutive pieces of `len` values (the last one
/// shorter when `x` is), empty pieces when `len` is 0.
fn pieces<T>(x: &mut [T], len: usize, count: usize) -> Vec<&mut [T]> {
    let mut out = Vec::with_capacity(count);
    let mut rest = x;
    for _ in 0..count {
        let (head, tail) = rest.split_at_mut(len.min(rest.len()));
        out.push(head);
        rest = tail;
    }
    out
}

/// Runs `work(scratch, task)` for every task: on the calling thread, or
/// when `parallel` on it and the pool's other threads, each taking the
/// next task when it has finished one (so a core slowed by a neighbour
/// holds nothing up), with one `init()` scratch per thread that takes any.
fn run_tasks<Task: Send, S>(
    tasks: Vec<Task>,
    parallel: bool,
    init: impl Fn() -> S + Sync,
    work: impl Fn(&mut S, Task) + Sync,
) {
    let workers = rayon::current_num_threads().min(tasks.len());
    if !parallel || workers <= 1 {
        let mut scratch = init();
        for task in tasks {
            work(&mut scratch, task);
        }
        return;
    }
    let count = tasks.len();
    crate::pool::for_each_item_init(tasks.into_iter(), count, init, work);
}

/// Whether the call is worth splitting over threads.
fn is_parallel(g: &AttentionGeometry) -> bool {
    let work = g
        .heads
        .saturating_mul(g.t)
        .saturating_mul(g.s)
        .saturating_mul(g.d + g.dv);
    work > PARALLEL_WORK
}

/// `O` and `L` of every head (`q: [heads, t, d]` and so on, row-major).
pub(crate) fn forward<T: Float>(
    level: Level,
    g: &AttentionGeometry,
    (q, k, v): (&[T], &[T], &[T]),
    o: &mut [T],
    lse: &mut [T],
) {
    if g.heads == 0 || g.t == 0 {
        return;
    }
    if g.d == 0 && g.dv == 0 {
        // Nothing to multiply, and `S` may be as large as a dimension
        // can be (k and v are empty whatever it is): every score is 0, so
        // each row's log-sum-exp is the log of how many keys it sees.
        for (i, l) in lse.iter_mut().enumerate() {
            let seen = g.keys_seen((i / g.interleaved) % g.t);
            *l = if seen == 0 {
                T::NEG_INFINITY
            } else {
                T::from_f64((seen as f64).ln())
            };
        }
        return;
    }
    let blocks = g.t.div_ceil(BLOCK_Q);
    let (units, per_unit) = (g.heads / g.interleaved, g.interleaved);
    let (ld_qk, ld_v) = strides(g);
    let mut tasks = Vec::with_capacity(units * blocks);
    let units_o = pieces(o, g.t * ld_v, units);
    let units_l = pieces(lse, g.t * per_unit, units);
    for (unit, (o, lse)) in units_o.into_iter().zip(units_l).enumerate() {
        let os = pieces(o, BLOCK_Q * ld_v, blocks);
        let ls = pieces(lse, BLOCK_Q * per_unit, blocks);
        let mut unit_tasks: Vec<QueryBlock<'_, T>> = os
            .into_iter()
            .zip(ls)
            .enumerate()
            .map(|(b, (o, lse))| QueryBlock {
                unit,
                first: b * BLOCK_Q,
                rows: BLOCK_Q.min(g.t - b * BLOCK_Q),
                o,
                lse,
            })
            .collect();
        // Later blocks see more keys under causal masking: started first,
        // they leave the short ones to even out the threads at the end.
        unit_tasks.reverse();
        tasks.extend(unit_tasks);
    }
    let head_of = |h: usize| Head {
        q: tail(q, first_row(g, h, g.t, g.d)),
        k: tail(k, first_row(g, h, g.s, g.d)),
        v: tail(v, first_row(g, h, g.s, g.dv)),
        ld_qk,
        ld_v,
    };
    run_tasks(
        tasks,
        is_parallel(g),
        || ForwardScratch::new(g),
        |scratch, block| {
            for within in 0..per_unit {
                let rows = HeadRows {
                    first: block.first,
                    rows: block.rows,
                    o: &mut block.o[within * g.dv..],
                    lse: &mut block.lse[within..],
                    ld_o: ld_v,
                    ld_l: per_unit,
                };
                let head = head_of(block.unit * per_unit + within);
                forward_block_on(level, g, head, rows, scratch)
            }
        },
    );
}

// ---------------------------------------------------------------------------
// Backward.

/// One head's inputs to the backward pass, from its first row on: rows of
/// `q` and `k` are `ld_qk` apart, of `v`, `dO` and `O` `ld_v`, of `L`
/// `ld_l`.
#[derive(Clone, Copy)]
struct GradHead<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    d_o: &'a [T],
    o: &'a [T],
    lse: &'a [T],
    ld_qk: usize,
    ld_v: usize,
    ld_l: usize,
}

/// What a thread of the backward pass works in.
struct BackwardScratch<T> {
    /// A key block transposed and scaled: `kt[c·BLOCK_K + j]` is
    /// `k[j][c]·scale`, zero past the block's keys.
    kt: Vec<T>,
    /// A value block transposed, `vt[e·BLOCK_K + j] = v[j][e]`.
    vt: Vec<T>,
    /// A block of scores, then probabilities (queries × keys).
    p: Vec<T>,
    /// A block of `dP`, then `dS`.
    ds: Vec<T>,
    /// `Δ = rowsum(dO ∘ O)` of the task's head.
    delta: Vec<T>,
}

impl<T: Float> BackwardScratch<T> {
    fn new(g: &AttentionGeometry) -> BackwardScratch<T> {
        BackwardScratch {
            kt: vec![T::ZERO; g.d * BLOCK_K],
            vt: vec![T::ZERO; g.dv * BLOCK_K],
            p: vec![T::ZERO; BLOCK_Q * BLOCK_K],
            ds: vec![T::ZERO; BLOCK_Q * BLOCK_K],
            delta: vec![T::ZERO; g.t],
        }
    }
}

/// A key block's rows of `dK` and `dV` (a unit's: every head of it).
struct KeyBlock<'a, T> {
    first: usize,
    dk: &'a mut [T],
    dv: &'a mut [T],
}

/// A backward task: a unit's (one head's, or with the `"bthd"` layout a
/// batch element's heads') group of key blocks, and the `dQ` rows (the
/// unit's own, or its group's buffer) they accumulate into.
struct GradTask<'a, T> {
    unit: usize,
    dq: &'a mut [T],
    blocks: Vec<KeyBlock<'a, T>>,
}

/// One head's share of a [`GradTask`]: its cells of `dQ` and of each key
/// block's `dK` and `dV`, from the head's first row on (rows `ld_qk` and
/// `ld_v` apart, zeroed by the task).
struct HeadGrads<'a, T> {
    dq: &'a mut [T],
    blocks: Vec<KeyBlock<'a, T>>,
}

/// The groups each head's key blocks are dealt into (round robin, so that
/// under causal masking, where early key blocks are seen by more queries,
/// the groups carry about equal work): 1 when there are heads enough for
/// the threads. Depends on the shape alone.
fn key_groups(g: &AttentionGeometry) -> usize {
    let blocks = g.s.div_ceil(BLOCK_K);
    BACKWARD_TASKS.div_ceil(g.heads.max(1)).min(blocks).max(1)
}

/// A task's key blocks against every query that sees them.
#[inline(always)]
fn backward_task<T: Float, I: Isa>(
    g: &AttentionGeometry,
    head: GradHead<'_, T>,
    task: HeadGrads<'_, T>,
    scratch: &mut BackwardScratch<T>,
) {
    let (d, dv) = (g.d, g.dv);
    let scale = T::from_f64(g.scale);
    let BackwardScratch {
        kt,
        vt,
        p,
        ds,
        delta,
    } = scratch;
    let dq = task.dq;
    let (ld_qk, ld_v) = (head.ld_qk, head.ld_v);
    // Queries before the task's first key see none of its keys.
    let from = match (g.causal, task.blocks.first()) {
        (true, Some(first)) => first.first.min(g.t),
        _ => 0,
    };
    for (i, delta) in delta.iter_mut().enumerate().take(g.t).skip(from) {
        let (x, y) = (
            &head.d_o[i * ld_v..i * ld_v + dv],
            &head.o[i * ld_v..i * ld_v + dv],
        );
        *delta = x
            .iter()
            .zip(y)
            .fold(T::ZERO, |acc, (&x, &y)| x.mul_plus::<I>(y, acc));
    }
    for block in task.blocks {
        let j0 = block.first;
        let bc = BLOCK_K.min(g.s - j0);
        for c in 0..d {
            let lane = &mut kt[c * BLOCK_K..(c + 1) * BLOCK_K];
            for (jj, x) in lane[..bc].iter_mut().enumerate() {
                *x = head.k[(j0 + jj) * ld_qk + c] * scale;
            }
            lane[bc..].fill(T::ZERO);
        }
        for e in 0..dv {
            let lane = &mut vt[e * BLOCK_K..(e + 1) * BLOCK_K];
            for (jj, x) in lane[..bc].iter_mut().enumerate() {
                *x = head.v[(j0 + jj) * ld_v + e];
            }
            lane[bc..].fill(T::ZERO);
        }
        let (dk, dvb) = (block.dk, block.dv);
        let first_query = if g.causal { j0 } else { 0 };
        let mut i0 = first_query;
        while i0 < g.t {
            let br = BLOCK_Q.min(g.t - i0);
            // The causal diagonal: the first query block, `i0 == j0`.
            let diagonal = g.causal && i0 == j0 && br > SPLIT && bc > SPLIT;
            let gemm = |p: &Product<'_, T>, c: &mut [T], ldc, accumulate, roles| {
                causal_gemm::<T, I>(p, c, ldc, accumulate, (diagonal, roles))
            };
            let scores = Product {
                m: br,
                n: bc,
                k: d,
                a: &head.q[i0 * ld_qk..],
                a_layout: Layout::Rows(ld_qk),
                b: kt,
                ldb: BLOCK_K,
                readable: BLOCK_K,
            };
            gemm(&scores, p, BLOCK_K, false, Diagonal::QueriesByKeyColumns);
            for ii in 0..br {
                let i = i0 + ii;
                let seen = if g.causal {
                    (i + 1).saturating_sub(j0).min(bc)
                } else {
                    bc
                };
                let l = head.lse[i * head.ld_l];
                let row = &mut p[ii * BLOCK_K..ii * BLOCK_K + bc];
                for x in row[..seen].iter_mut() {
                    *x = (*x - l).exp::<I>();
                }
                row[seen..].fill(T::ZERO);
            }
            let d_o = &head.d_o[i0 * ld_v..];
            // dV += Pᵀ·dO
            let values = Product {
                m: bc,
                n: dv,
                k: br,
                a: p,
                a_layout: Layout::Columns(BLOCK_K),
                b: d_o,
                ldb: ld_v,
                readable: dv,
            };
            gemm(&values, dvb, ld_v, true, Diagonal::KeysOverQueries);
            // dP = dO·Vᵀ
            let weights = Product {
                m: br,
                n: bc,
                k: dv,
                a: d_o,
                a_layout: Layout::Rows(ld_v),
                b: vt,
                ldb: BLOCK_K,
                readable: BLOCK_K,
            };
            gemm(&weights, ds, BLOCK_K, false, Diagonal::QueriesByKeyColumns);
            // dS = scale·P ∘ (dP − Δ), on the diagonal only where dP was
            // computed.
            for ii in 0..br {
                let centre = delta[i0 + ii];
                let keys = if diagonal && ii < SPLIT { SPLIT } else { bc };
                let (ds, p) = (
                    &mut ds[ii * BLOCK_K..ii * BLOCK_K + keys],
                    &p[ii * BLOCK_K..ii * BLOCK_K + keys],
                );
                for (x, &y) in ds.iter_mut().zip(p) {
                    *x = y * (*x - centre) * scale;
                }
            }
            // dQ += dS·K
            let to_queries = Product {
                m: br,
                n: d,
                k: bc,
                a: ds,
                a_layout: Layout::Rows(BLOCK_K),
                b: &head.k[j0 * ld_qk..],
                ldb: ld_qk,
                readable: d,
            };
            gemm(
                &to_queries,
                &mut dq[i0 * ld_qk..],
                ld_qk,
                true,
                Diagonal::QueriesOverKeys,
            );
            // dK += dSᵀ·Q
            let to_keys = Product {
                m: bc,
                n: d,
                k: br,
                a: ds,
                a_layout: Layout::Columns(BLOCK_K),
                b: &head.q[i0 * ld_qk..],
                ldb: ld_qk,
                readable: d,
            };
            gemm(&to_keys, dk, ld_qk, true, Diagonal::KeysOverQueries);
            i0 += br;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn backward_task_avx2<T: Float>(
    g: &AttentionGeometry,
    head: GradHead<'_, T>,
    task: HeadGrads<'_, T>,
    scratch: &mut BackwardScratch<T>,
) {
    backward_task::<T, Avx2>(g, head, task, scratch)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn backward_task_avx512<T: Float>(
    g: &AttentionGeometry,
    head: GradHead<'_, T>,
    task: HeadGrads<'_, T>,
    scratch: &mut BackwardScratch<T>,
) {
    backward_task::<T, Avx512>(g, head, task, scratch)
}

fn backward_task_on<T: Float>(
    level: Level,
    g: &AttentionGeometry,
    head: GradHead<'_, T>,
    task: HeadGrads<'_, T>,
    scratch: &mut BackwardScratch<T>,
) {
    match level {
        Level::Baseline => backward_task::<T, Baseline>(g, head, task, scratch),
        // SAFETY: `level` is at most what `level()` detected on this CPU,
        // which has AVX2 and FMA, all `backward_task_avx2` is compiled to
        // use.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { backward_task_avx2(g, head, task, scratch) },
        // SAFETY: as above, with AVX-512F.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { backward_task_avx512(g, head, task, scratch) },
    }
}

/// The inputs of the backward pass, each `[heads, rows, width]` row-major.
pub(crate) struct GradInputs<'a, T> {
    pub d_o: &'a [T],
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub o: &'a [T],
    pub lse: &'a [T],
}

/// `(dq, dk, dv)` of every head.
pub(crate) fn backward<T: Float>(
    level: Level,
    g: &AttentionGeometry,
    x: &GradInputs<'_, T>,
    (dq, dk, dv): (&mut [T], &mut [T], &mut [T]),
) {
    if g.heads == 0 || g.t == 0 || g.s == 0 {
        // No query sees a key: every gradient is zero.
        dq.fill(T::ZERO);
        dk.fill(T::ZERO);
        dv.fill(T::ZERO);
        return;
    }
    if g.d == 0 && g.dv == 0 {
        // All three are empty; `S` may be huge, so no loop over it runs.
        return;
    }
    let key_blocks = g.s.div_ceil(BLOCK_K);
    let groups = key_groups(g);
    let (units, per_unit) = (g.heads / g.interleaved, g.interleaved);
    let (ld_qk, ld_v) = strides(g);
    // A unit's dQ rows, and those of every unit's groups after the first.
    let unit_rows = g.t * ld_qk;
    let mut extra = vec![T::ZERO; units * (groups - 1) * unit_rows];
    let mut tasks = Vec::with_capacity(units * groups);
    {
        let dq_units = pieces(dq, unit_rows, units);
        let dk_units = pieces(dk, g.s * ld_qk, units);
        let dv_units = pieces(dv, g.s * ld_v, units);
        let mut extra_units = pieces(&mut extra, (groups - 1) * unit_rows, units).into_iter();
        for (unit, ((dq, dk), dv)) in dq_units.into_iter().zip(dk_units).zip(dv_units).enumerate() {
            let extra = extra_units.next().unwrap_or_default();
            let mut group_dq = vec![dq];
            group_dq.extend(pieces(extra, unit_rows, groups - 1));
            let mut group_tasks: Vec<GradTask<'_, T>> = group_dq
                .into_iter()
                .map(|dq| GradTask {
                    unit,
                    dq,
                    blocks: Vec::new(),
                })
                .collect();
            let dks = pieces(dk, BLOCK_K * ld_qk, key_blocks);
            let dvs = pieces(dv, BLOCK_K * ld_v, key_blocks);
            for (b, (dk, dv)) in dks.into_iter().zip(dvs).enumerate() {
                group_tasks[b % groups].blocks.push(KeyBlock {
                    first: b * BLOCK_K,
                    dk,
                    dv,
                });
            }
            tasks.extend(group_tasks);
        }
    }
    let head_of = |h: usize| GradHead {
        q: tail(x.q, first_row(g, h, g.t, g.d)),
        k: tail(x.k, first_row(g, h, g.s, g.d)),
        v: tail(x.v, first_row(g, h, g.s, g.dv)),
        d_o: tail(x.d_o, first_row(g, h, g.t, g.dv)),
        o: tail(x.o, first_row(g, h, g.t, g.dv)),
        lse: tail(x.lse, g.row(h, g.t, 0)),
        ld_qk,
        ld_v,
        ld_l: per_unit,
    };
    run_tasks(
        tasks,
        is_parallel(g),
        || BackwardScratch::new(g),
        |scratch, mut task| {
            // The task's heads share its rows, so they are zeroed once
            // here and each head accumulates into its own columns.
            task.dq.fill(T::ZERO);
            for block in task.blocks.iter_mut() {
                block.dk.fill(T::ZERO);
                block.dv.fill(T::ZERO);
            }
            for within in 0..per_unit {
                let grads = HeadGrads {
                    dq: &mut task.dq[within * g.d..],
                    blocks: task
                        .blocks
                        .iter_mut()
                        .map(|block| KeyBlock {
                            first: block.first,
                            dk: &mut block.dk[within * g.d..],
                            dv: &mut block.dv[within * g.dv..],
                        })
                        .collect(),
                };
                let head = head_of(task.unit * per_unit + within);
                backward_task_on(level, g, head, grads, scratch)
            }
        },
    );
    // In group order, whichever threads ran the groups.
    for (unit, dq) in pieces(dq, unit_rows, units).into_iter().enumerate() {
        for group in 1..groups {
            let part = &extra[(unit * (groups - 1) + group - 1) * unit_rows..][..unit_rows];
            for (x, &y) in dq.iter_mut().zip(part) {
                *x = *x + y;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Memory.

/// The memory an attention call takes beyond its inputs and outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workspace {
    /// Per thread, forward: transposed queries, a block of scores and
    /// three per-query vectors.
    pub forward_per_thread: usize,
    /// Per thread, backward: transposed key and value blocks, two blocks of
    /// scores, and `Δ` of a head.
    pub backward_per_thread: usize,
    /// Backward, once: the `dQ` buffers of each head's key groups after
    /// the first (none when there are as many heads as the backward pass
    /// makes tasks, 8).
    pub backward_shared: usize,
    /// f16 and bf16: f32 copies of the inputs and outputs (forward, then
    /// backward).
    pub widened: (usize, usize),
}

/// The bytes attention with `g`'s sizes and inputs of `dtype` allocates
/// besides its outputs, from the block sizes; a thread's share counts once
/// per thread that takes part (at most the pool's size).
pub fn workspace_bytes(g: &AttentionGeometry, dtype: DType) -> Workspace {
    let compute = if dtype == DType::F64 { 8 } else { 4 };
    let forward = (g.d * BLOCK_Q + BLOCK_K * BLOCK_Q + 3 * BLOCK_Q) * compute;
    let backward = ((g.d + g.dv) * BLOCK_K + 2 * BLOCK_Q * BLOCK_K + g.t) * compute;
    let groups = key_groups(g);
    let shared = g.heads * (groups - 1) * g.t * g.d * compute;
    let widened = if matches!(dtype, DType::F16 | DType::BF16) {
        let q = g.heads * g.t * g.d;
        let kv = g.heads * g.s * (g.d + g.dv);
        let o = g.heads * g.t * g.dv;
        // Forward: q, k, v and O; backward: dO, q, k, v, O, dq, dk, dv.
        ((q + kv + o) * 4, (2 * q + 2 * kv + 2 * o) * 4)
    } else {
        (0, 0)
    };
    Workspace {
        forward_per_thread: forward,
        backward_per_thread: backward,
        backward_shared: shared,
        widened,
    }
}

// ---------------------------------------------------------------------------
// Kernels.

/// A half-precision type's conversions to and from f32.
type Conversions<T> = (fn(T) -> f32, fn(f32) -> T);

fn widen<T: Copy>(values: &[T], f: fn(T) -> f32) -> Vec<f32> {
    values.iter().map(|&x| f(x)).collect()
}

fn narrow_into<T>(out: &mut [T], values: &[f32], f: fn(f32) -> T) {
    for (o, &x) in out.iter_mut().zip(values) {
        *o = f(x);
    }
}

/// The sizes of a call, from the inputs the kernel was handed (the kernel
/// cache keys kernels by dtypes, not shapes, so nothing shape-dependent is
/// kept from the factory).
fn geometry_of(inputs: &[&DenseHostTensor], ctx: &KernelContext<'_>) -> Result<AttentionGeometry> {
    let metas: Vec<TensorMetadata> = inputs.iter().map(|t| t.metadata().clone()).collect();
    attention_geometry(&metas, &ctx.attrs)
}

fn output(ctx: &KernelContext<'_>, index: usize) -> Result<TensorMetadata> {
    ctx.outputs
        .get(index)
        .cloned()
        .ok_or_else(|| Error::internal("attention kernel called without its output metadata"))
}

fn forward_factory(_: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let dtype = super::first_dtype(inputs)?;
    if !dtype.is_float() {
        return Err(Error::dtype(format!(
            "attention is not defined for {dtype}"
        )));
    }
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            let [q, k, v] = super::take(inputs)?;
            let g = geometry_of(&[&q, &k, &v], ctx)?;
            let mut o = DenseHostTensor::for_overwrite(output(ctx, 0)?)?;
            let mut lse = DenseHostTensor::for_overwrite(output(ctx, 1)?)?;
            let level = level();
            match dtype {
                DType::F32 => forward::<f32>(
                    level,
                    &g,
                    (q.as_slice()?, k.as_slice()?, v.as_slice()?),
                    o.as_mut_slice()?,
                    lse.as_mut_slice()?,
                ),
                DType::F64 => forward::<f64>(
                    level,
                    &g,
                    (q.as_slice()?, k.as_slice()?, v.as_slice()?),
                    o.as_mut_slice()?,
                    lse.as_mut_slice()?,
                ),
                DType::F16 => forward_half::<f16>(
                    level,
                    &g,
                    [&q, &k, &v],
                    &mut o,
                    &mut lse,
                    (f16::to_f32, f16::from_f32),
                )?,
                DType::BF16 => forward_half::<bf16>(
                    level,
                    &g,
                    [&q, &k, &v],
                    &mut o,
                    &mut lse,
                    (bf16::to_f32, bf16::from_f32),
                )?,
                other => {
                    return Err(Error::dtype(format!(
                        "attention is not defined for {other}"
                    )))
                }
            }
            Ok(smallvec![o, lse])
        },
    ))
}

/// f16 and bf16: the f32 kernel on widened copies, `O` rounded once.
fn forward_half<T: stagecraft_tensor::Element>(
    level: Level,
    g: &AttentionGeometry,
    [q, k, v]: [&DenseHostTensor; 3],
    o: &mut DenseHostTensor,
    lse: &mut DenseHostTensor,
    (wide, narrow): Conversions<T>,
) -> Result<()> {
    let (q, k, v) = (
        widen(q.as_slice::<T>()?, wide),
        widen(k.as_slice::<T>()?, wide),
        widen(v.as_slice::<T>()?, wide),
    );
    let mut out = vec![0.0f32; o.numel()];
    forward::<f32>(level, g, (&q, &k, &v), &mut out, lse.as_mut_slice()?);
    narrow_into(o.as_mut_slice::<T>()?, &out, narrow);
    Ok(())
}

fn backward_factory(_: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let dtype = super::first_dtype(inputs)?;
    if !dtype.is_float() {
        return Err(Error::dtype(format!(
            "attention is not defined for {dtype}"
        )));
    }
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            let [d_o, q, k, v, o, lse] = super::take(inputs)?;
            let g = geometry_of(&[&q, &k, &v], ctx)?;
            let mut dq = DenseHostTensor::for_overwrite(output(ctx, 0)?)?;
            let mut dk = DenseHostTensor::for_overwrite(output(ctx, 1)?)?;
            let mut dv = DenseHostTensor::for_overwrite(output(ctx, 2)?)?;
            let level = level();
            match dtype {
                DType::F32 => backward_typed::<f32>(
                    level,
                    &g,
                    [&d_o, &q, &k, &v, &o, &lse],
                    [&mut dq, &mut dk, &mut dv],
                )?,
                DType::F64 => backward_typed::<f64>(
                    level,
                    &g,
                    [&d_o, &q, &k, &v, &o, &lse],
                    [&mut dq, &mut dk, &mut dv],
                )?,
                DType::F16 => backward_half::<f16>(
                    level,
                    &g,
                    [&d_o, &q, &k, &v, &o, &lse],
                    [&mut dq, &mut dk, &mut dv],
                    (f16::to_f32, f16::from_f32),
                )?,
                DType::BF16 => backward_half::<bf16>(
                    level,
                    &g,
                    [&d_o, &q, &k, &v, &o, &lse],
                    [&mut dq, &mut dk, &mut dv],
                    (bf16::to_f32, bf16::from_f32),
                )?,
                other => {
                    return Err(Error::dtype(format!(
                        "attention is not defined for {other}"
                    )))
                }
            }
            Ok(smallvec![dq, dk, dv])
        },
    ))
}

fn backward_typed<T: Float + stagecraft_tensor::Element>(
    level: Level,
    g: &AttentionGeometry,
    [d_o, q, k, v, o, lse]: [&DenseHostTensor; 6],
    [dq, dk, dv]: [&mut DenseHostTensor; 3],
) -> Result<()> {
    let x = GradInputs {
        d_o: d_o.as_slice()?,
        q: q.as_slice()?,
        k: k.as_slice()?,
        v: v.as_slice()?,
        o: o.as_slice()?,
        lse: lse.as_slice()?,
    };
    backward::<T>(
        level,
        g,
        &x,
        (dq.as_mut_slice()?, dk.as_mut_slice()?, dv.as_mut_slice()?),
    );
    Ok(())
}

/// f16 and bf16: the f32 kernel on widened copies (`L` is f32 already),
/// the gradients rounded once.
fn backward_half<T: stagecraft_tensor::Element>(
    level: Level,
    g: &AttentionGeometry,
    [d_o, q, k, v, o, lse]: [&DenseHostTensor; 6],
    [dq, dk, dv]: [&mut DenseHostTensor; 3],
    (wide, narrow): Conversions<T>,
) -> Result<()> {
    let widened = [d_o, q, k, v, o].map(|t| t.as_slice::<T>().map(|x| widen(x, wide)));
    let [d_o, q, k, v, o] = widened;
    let (d_o, q, k, v, o) = (d_o?, q?, k?, v?, o?);
    let x = GradInputs {
        d_o: &d_o,
        q: &q,
        k: &k,
        v: &v,
        o: &o,
        lse: lse.as_slice::<f32>()?,
    };
    let mut wide_dq = vec![0.0f32; dq.numel()];
    let mut wide_dk = vec![0.0f32; dk.numel()];
    let mut wide_dv = vec![0.0f32; dv.numel()];
    backward::<f32>(level, g, &x, (&mut wide_dq, &mut wide_dk, &mut wide_dv));
    narrow_into(dq.as_mut_slice::<T>()?, &wide_dq, narrow);
    narrow_into(dk.as_mut_slice::<T>()?, &wide_dk, narrow);
    narrow_into(dv.as_mut_slice::<T>()?, &wide_dv, narrow);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::attention::{self as reference, Sizes};

    /// Every level this CPU runs, from the baseline up.
    fn levels() -> Vec<Level> {
        let mut all = vec![Level::Baseline];
        #[cfg(target_arch = "x86_64")]
        all.extend([Level::Avx2, Level::Avx512]);
        all.retain(|&l| l <= level());
        all
    }

    /// `n` values in [-range, range), from a hash of the index and `seed`.
    fn values(n: usize, seed: u64, range: f64) -> Vec<f64> {
        (0..n as u64)
            .map(|i| {
                let h = (i ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                    .wrapping_mul(0xD1B5_4A32_D192_ED03)
                    .rotate_left(29)
                    .wrapping_mul(0x94D0_49BB_1331_11EB);
                ((h >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * range
            })
            .collect()
    }

    fn geometry(
        (heads, t, s, d, dv): (usize, usize, usize, usize, usize),
        causal: bool,
        scale: f64,
    ) -> AttentionGeometry {
        AttentionGeometry {
            heads,
            t,
            s,
            d,
            dv,
            causal,
            scale,
            interleaved: 1,
        }
    }

    fn sizes(g: &AttentionGeometry) -> Sizes {
        Sizes {
            heads: g.heads,
            t: g.t,
            s: g.s,
            d: g.d,
            dv: g.dv,
        }
    }

    /// Random inputs of `g`'s sizes, rounded to `T`, as `T` and as f64.
    struct Data<T> {
        q: Vec<T>,
        k: Vec<T>,
        v: Vec<T>,
        g: Vec<T>,
        wide: [Vec<f64>; 4],
    }

    fn data<T: Copy>(g: &AttentionGeometry, to: fn(f64) -> T, back: fn(T) -> f64) -> Data<T> {
        let make = |n: usize, seed: u64, range: f64| -> (Vec<T>, Vec<f64>) {
            let v: Vec<T> = values(n, seed, range).into_iter().map(to).collect();
            let w = v.iter().map(|&x| back(x)).collect();
            (v, w)
        };
        // Queries and keys spread the scores over a few units, so that
        // the softmax is neither flat nor one-hot.
        let (q, wq) = make(g.heads * g.t * g.d, 1, 1.5);
        let (k, wk) = make(g.heads * g.s * g.d, 2, 1.5);
        let (v, wv) = make(g.heads * g.s * g.dv, 3, 1.0);
        let (d_o, wg) = make(g.heads * g.t * g.dv, 4, 1.0);
        Data {
            q,
            k,
            v,
            g: d_o,
            wide: [wq, wk, wv, wg],
        }
    }

    /// `|got - want| ≤ tol·(1 + |want|)` everywhere, infinities equal.
    #[track_caller]
    fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (&x, &y)) in got.iter().zip(want).enumerate() {
            let ok = if y.is_infinite() {
                x == y
            } else {
                (x - y).abs() <= tol * (1.0 + y.abs())
            };
            assert!(ok, "{what}[{i}]: {x} vs {y}");
        }
    }

    /// Shapes that cover single rows, keys and features, sizes on both
    /// sides of the blocks (64) and the tiles (4 rows, 8 to 64 columns),
    /// T ≠ S both ways, and enough heads to split into groups or not.
    const SHAPES: &[(usize, usize, usize, usize, usize)] = &[
        (1, 1, 1, 1, 1),
        (2, 1, 5, 3, 2),
        (2, 5, 1, 3, 2),
        (1, 7, 7, 1, 1),
        (3, 65, 63, 5, 7),
        (2, 100, 37, 16, 8),
        (1, 37, 150, 33, 17),
        (1, 64, 64, 64, 64),
        (2, 129, 131, 64, 40),
        (1, 200, 70, 8, 72),
    ];

    fn run_forward<T: Float>(level: Level, g: &AttentionGeometry, d: &Data<T>) -> (Vec<T>, Vec<T>) {
        let mut o = vec![T::from_f64(f64::NAN); g.heads * g.t * g.dv];
        let mut lse = vec![T::from_f64(f64::NAN); g.heads * g.t];
        forward(level, g, (&d.q, &d.k, &d.v), &mut o, &mut lse);
        (o, lse)
    }

    fn run_backward<T: Float>(
        level: Level,
        g: &AttentionGeometry,
        d: &Data<T>,
        (o, lse): (&[T], &[T]),
    ) -> [Vec<T>; 3] {
        let nan = T::from_f64(f64::NAN);
        let mut dq = vec![nan; g.heads * g.t * g.d];
        // `S·D` first: S may be huge when D is 0.
        let mut dk = vec![nan; g.heads * (g.s * g.d)];
        let mut dv = vec![nan; g.heads * (g.s * g.dv)];
        let x = GradInputs {
            d_o: &d.g,
            q: &d.q,
            k: &d.k,
            v: &d.v,
            o,
            lse,
        };
        backward(level, g, &x, (&mut dq, &mut dk, &mut dv));
        [dq, dk, dv]
    }

    /// Compares every level with the reference within `tol` relative to
    /// the scores' spread: the softmax's condition grows with it (a
    /// rounding error ε of a score of size σ moves its weight by about
    /// σε), and here it is `|scale|·√D` times the inputs' own.
    fn check<T: Float>(to: fn(f64) -> T, back: fn(T) -> f64, tol: f64) {
        for &shape in SHAPES {
            for (causal, scale) in [(false, 0.3), (true, 0.3), (true, -0.8), (false, 1.7)] {
                let g = geometry(shape, causal, scale);
                let tol = tol * (1.0 + scale.abs() * (g.d as f64).sqrt());
                let d = data(&g, to, back);
                let [q, k, v, dout] = &d.wide;
                let n = sizes(&g);
                let (want_o, want_l) = reference::attention(q, k, v, n, causal, scale);
                let want = reference::attention_grad(dout, q, k, v, n, causal, scale);
                for level in levels() {
                    let what = |name: &str| {
                        format!("{name} {shape:?} causal {causal} scale {scale} {level:?}")
                    };
                    let (o, lse) = run_forward(level, &g, &d);
                    let wide = |x: &[T]| x.iter().map(|&v| back(v)).collect::<Vec<f64>>();
                    assert_close(&what("O"), &wide(&o), &want_o, tol);
                    assert_close(&what("L"), &wide(&lse), &want_l, tol);
                    let grads = run_backward(level, &g, &d, (&o, &lse));
                    for (name, got, want) in [
                        ("dq", &grads[0], &want.0),
                        ("dk", &grads[1], &want.1),
                        ("dv", &grads[2], &want.2),
                    ] {
                        assert_close(&what(name), &wide(got), want, tol);
                    }
                }
            }
        }
    }

    /// `[B, H, rows, width]` values as `[B, rows, H, width]` (`back`
    /// false), or the other way.
    fn swap_heads<T: Copy>(
        x: &[T],
        (b, h, rows, width): (usize, usize, usize, usize),
        back: bool,
    ) -> Vec<T> {
        let mut out = x.to_vec();
        for bi in 0..b {
            for hh in 0..h {
                for i in 0..rows {
                    let heads_first = ((bi * h + hh) * rows + i) * width;
                    let rows_first = ((bi * rows + i) * h + hh) * width;
                    let (from, to) = if back {
                        (rows_first, heads_first)
                    } else {
                        (heads_first, rows_first)
                    };
                    out[to..to + width].copy_from_slice(&x[from..from + width]);
                }
            }
        }
        out
    }

    /// The `"bthd"` layout reads each head's rows in place, `H` heads
    /// apart, and its tasks cover a batch element's heads: its results
    /// are the `"bhtd"` layout's, transposed, to the bit, forward and
    /// backward, on every level, with one group of key blocks per head or
    /// several (few heads, many keys).
    fn layouts_agree<T: Float + PartialEq + std::fmt::Debug>(to: fn(f64) -> T, back: fn(T) -> f64) {
        for (b, h, t, s, d, dv) in [
            (2, 3, 5, 7, 4, 3),
            (3, 1, 65, 63, 5, 7),
            (1, 2, 150, 200, 16, 8),
            (2, 4, 64, 64, 32, 32),
            (1, 3, 1, 130, 8, 5),
        ] {
            for causal in [false, true] {
                let heads_first = geometry((b * h, t, s, d, dv), causal, 0.4);
                let rows_first = AttentionGeometry {
                    interleaved: h,
                    ..heads_first
                };
                let data = data(&heads_first, to, back);
                let swapped = Data {
                    q: swap_heads(&data.q, (b, h, t, d), false),
                    k: swap_heads(&data.k, (b, h, s, d), false),
                    v: swap_heads(&data.v, (b, h, s, dv), false),
                    g: swap_heads(&data.g, (b, h, t, dv), false),
                    wide: data.wide.clone(),
                };
                for level in levels() {
                    let what = format!("{:?} causal {causal} {level:?}", (b, h, t, s, d, dv));
                    let (o, lse) = run_forward(level, &heads_first, &data);
                    let (o2, lse2) = run_forward(level, &rows_first, &swapped);
                    assert_eq!(swap_heads(&o2, (b, h, t, dv), true), o, "O {what}");
                    assert_eq!(swap_heads(&lse2, (b, h, t, 1), true), lse, "L {what}");
                    let grads = run_backward(level, &heads_first, &data, (&o, &lse));
                    let grads2 = run_backward(level, &rows_first, &swapped, (&o2, &lse2));
                    for (i, (rows, width)) in [(t, d), (s, d), (s, dv)].into_iter().enumerate() {
                        assert_eq!(
                            swap_heads(&grads2[i], (b, h, rows, width), true),
                            grads[i],
                            "gradient {i} {what}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_two_layouts_give_the_same_bits() {
        layouts_agree::<f32>(|x| x as f32, |x| x as f64);
        layouts_agree::<f64>(|x| x, |x| x);
    }

    #[test]
    fn f64_matches_the_reference_on_every_level() {
        check::<f64>(|x| x, |x| x, 1e-12);
    }

    #[test]
    fn f32_matches_the_reference_on_every_level() {
        check::<f32>(|x| x as f32, |x| x as f64, 1e-5);
    }

    /// Every level and every thread count gives the same bits within a
    /// level: each output element is computed by one task in an order
    /// fixed by the shape, and dQ's groups are added in group order.
    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        for shape in [(1, 300, 260, 32, 16), (12, 150, 150, 16, 16)] {
            let g = geometry(shape, true, 0.25);
            assert!(is_parallel(&g));
            let d = data::<f32>(&g, |x| x as f32, |x| x as f64);
            for level in levels() {
                let run = |threads: usize| {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    pool.install(|| {
                        let (o, lse) = run_forward(level, &g, &d);
                        let grads = run_backward(level, &g, &d, (&o, &lse));
                        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
                        [
                            bits(&o),
                            bits(&lse),
                            bits(&grads[0]),
                            bits(&grads[1]),
                            bits(&grads[2]),
                        ]
                    })
                };
                let one = run(1);
                for threads in [2, 3, 4] {
                    assert!(
                        run(threads) == one,
                        "{shape:?} {level:?} on {threads} threads"
                    );
                }
            }
        }
        // One head splits its keys into groups; twelve do not.
        assert_eq!(key_groups(&geometry((1, 300, 260, 32, 16), true, 1.0)), 5);
        assert_eq!(key_groups(&geometry((12, 150, 150, 16, 16), true, 1.0)), 1);
    }

    /// Zero-size dimensions: no keys give zeros and `L = -∞` (and zero
    /// gradients), no features give uniform weights, and no features and
    /// no values give `L = ln(keys seen)` without looping over the keys,
    /// however many there are.
    #[test]
    fn zero_size_dimensions() {
        for level in levels() {
            let g = geometry((2, 3, 0, 4, 2), true, 1.0);
            let d = data::<f64>(&g, |x| x, |x| x);
            let (o, lse) = run_forward(level, &g, &d);
            assert_eq!(o, vec![0.0; 12]);
            assert_eq!(lse, vec![f64::NEG_INFINITY; 6]);
            let [dq, dk, dv] = run_backward(level, &g, &d, (&o, &lse));
            assert_eq!(dq, vec![0.0; 24]);
            assert!(dk.is_empty() && dv.is_empty());

            // D = 0: every score is 0, the output the mean of the values
            // each query sees.
            let g = geometry((1, 3, 2, 0, 1), true, 1.0);
            let mut d = data::<f64>(&g, |x| x, |x| x);
            d.v = vec![2.0, 4.0];
            let (o, lse) = run_forward(level, &g, &d);
            assert_eq!(o, vec![2.0, 3.0, 3.0]);
            assert_close("L", &lse, &[0.0, 2f64.ln(), 2f64.ln()], 1e-15);
            let [dq, dk, dv] = run_backward(level, &g, &d, (&o, &lse));
            assert!(dq.is_empty() && dk.is_empty());
            // dv = Pᵀ·dO with P = [[1, 0], [1/2, 1/2], [1/2, 1/2]].
            let gr = &d.g;
            assert_close(
                "dv",
                &dv,
                &[gr[0] + (gr[1] + gr[2]) / 2.0, (gr[1] + gr[2]) / 2.0],
                1e-15,
            );

            let g = geometry((2, 3, usize::MAX, 0, 0), true, 1.0);
            let d = Data::<f64> {
                q: vec![],
                k: vec![],
                v: vec![],
                g: vec![],
                wide: Default::default(),
            };
            let (o, lse) = run_forward(level, &g, &d);
            assert!(o.is_empty());
            let ln = |x: f64| x.ln();
            assert_eq!(lse, [0.0, ln(2.0), ln(3.0), 0.0, ln(2.0), ln(3.0)]);
            let all = AttentionGeometry { causal: false, ..g };
            let (_, lse) = run_forward(level, &all, &d);
            assert_eq!(lse[0], (usize::MAX as f64).ln());
            let [dq, dk, dv] = run_backward(level, &g, &d, (&o, &lse));
            assert!(dq.is_empty() && dk.is_empty() && dv.is_empty());

            for g in [
                geometry((0, 3, 4, 2, 2), false, 1.0),
                geometry((2, 0, 4, 2, 2), false, 1.0),
            ] {
                let d = data::<f32>(&g, |x| x as f32, |x| x as f64);
                let (o, lse) = run_forward(level, &g, &d);
                assert!(o.is_empty() && lse.is_empty());
                let [dq, dk, dv] = run_backward(level, &g, &d, (&o, &lse));
                assert!(dq.is_empty());
                assert!(dk.iter().chain(&dv).all(|&x| x == 0.0));
            }
        }
    }

    /// NaN in a query row makes that row NaN and no other; a row whose
    /// scores are all -∞ (a key of -∞ against a positive query) is a row
    /// without keys: zeros.
    #[test]
    fn nan_and_infinite_scores() {
        for level in levels() {
            let g = geometry((1, 2, 3, 1, 1), false, 1.0);
            let mut d = data::<f32>(&g, |x| x as f32, |x| x as f64);
            d.q = vec![f32::NAN, 1.0];
            d.k = vec![0.5, -1.0, 0.25];
            let (o, lse) = run_forward(level, &g, &d);
            assert!(o[0].is_nan() && lse[0].is_nan());
            assert!(o[1].is_finite() && lse[1].is_finite());
            d.q = vec![1.0, 1.0];
            d.k = vec![f32::NEG_INFINITY; 3];
            let (o, lse) = run_forward(level, &g, &d);
            assert_eq!(o, [0.0, 0.0]);
            assert_eq!(lse, [f32::NEG_INFINITY; 2]);
        }
    }

    /// The f32 exponential against f64's, in ulps, on every level, over
    /// the arguments attention forms; exact at 0 and for -∞.
    #[test]
    fn f32_exp_is_within_two_ulps() {
        fn exp_on(level: Level, x: f32) -> f32 {
            match level {
                Level::Baseline => exp_f32::<Baseline>(x),
                #[cfg(target_arch = "x86_64")]
                Level::Avx2 | Level::Avx512 => exp_f32::<Avx2>(x),
            }
        }
        for level in levels() {
            let mut worst = 0.0f64;
            for i in 0..200_000 {
                let x = -87.0 * (i as f32 / 200_000.0);
                let (got, want) = (exp_on(level, x) as f64, (x as f64).exp());
                let ulp = (want as f32).abs() as f64 * f32::EPSILON as f64;
                worst = worst.max((got - want).abs() / ulp);
            }
            assert!(worst <= 2.0, "{level:?}: {worst} ulps");
            assert_eq!(exp_on(level, 0.0), 1.0);
            assert_eq!(exp_on(level, f32::NEG_INFINITY), 0.0);
            assert_eq!(exp_on(level, -100.0), 0.0);
            assert!(exp_on(level, f32::NAN).is_nan());
        }
    }

    /// f16 and bf16 compute in f32 and round once: within their own
    /// precision of the f64 reference, through the registered kernels.
    #[test]
    fn half_precision_through_the_kernels() {
        use stagecraft_ops::{
            OpAttrs, SCALED_DOT_PRODUCT_ATTENTION as FWD, SCALED_DOT_PRODUCT_ATTENTION_GRAD as BWD,
        };
        let g = geometry((2, 70, 40, 8, 8), true, 0.5);
        let d64 = data::<f64>(&g, |x| x, |x| x);
        let [q, k, v, dout] = &d64.wide;
        let (want_o, _) = reference::attention(q, k, v, sizes(&g), true, 0.5);
        let want = reference::attention_grad(dout, q, k, v, sizes(&g), true, 0.5);
        let mut attrs = OpAttrs::new();
        attrs.set_bool("causal", true).set_float("scale", 0.5);
        fn tensor<T: stagecraft_tensor::Element>(
            x: &[f64],
            dims: [usize; 3],
            to: fn(f64) -> T,
        ) -> DenseHostTensor {
            let v: Vec<T> = x.iter().map(|&x| to(x)).collect();
            DenseHostTensor::from_slice(&v, dims).unwrap()
        }
        fn run(
            def: &'static stagecraft_ops::OpDef,
            attrs: &OpAttrs,
            inputs: Vec<DenseHostTensor>,
        ) -> Outputs {
            let metas: Vec<TensorMetadata> = inputs.iter().map(|t| t.metadata().clone()).collect();
            let outs = def.infer(&metas, attrs).unwrap();
            let kernel =
                (crate::registry().get(def).unwrap())(&Attrs::new(attrs, def), &metas).unwrap();
            let ctx = KernelContext {
                attrs: Attrs::new(attrs, def),
                outputs: &outs,
            };
            kernel(inputs.into_iter().collect(), &ctx).unwrap()
        }
        fn wide<T: stagecraft_tensor::Element>(t: &DenseHostTensor, f: fn(T) -> f64) -> Vec<f64> {
            t.as_slice::<T>().unwrap().iter().map(|&x| f(x)).collect()
        }
        macro_rules! case {
            ($t:ty, $tol:expr) => {{
                let to = |x: f64| <$t>::from_f64(x);
                let back = |x: $t| x.to_f64();
                let (qd, kd, vd) = ([2, 70, 8], [2, 40, 8], [2, 40, 8]);
                let fwd = run(
                    &FWD,
                    &attrs,
                    vec![tensor(q, qd, to), tensor(k, kd, to), tensor(v, vd, to)],
                );
                assert_close("O", &wide(&fwd[0], back), &want_o, $tol);
                let inputs = vec![
                    tensor(dout, qd, to),
                    tensor(q, qd, to),
                    tensor(k, kd, to),
                    tensor(v, vd, to),
                    fwd[0].clone(),
                    fwd[1].clone(),
                ];
                let grads = run(&BWD, &attrs, inputs);
                assert_close("dq", &wide(&grads[0], back), &want.0, $tol);
                assert_close("dk", &wide(&grads[1], back), &want.1, $tol);
                assert_close("dv", &wide(&grads[2], back), &want.2, $tol);
            }};
        }
        case!(f16, 1e-2);
        case!(bf16, 6e-2);
    }

    #[test]
    fn workspace_follows_the_block_sizes() {
        let g = geometry((32, 1024, 1024, 64, 64), true, 0.125);
        let w = workspace_bytes(&g, DType::F32);
        assert_eq!(w.forward_per_thread, (64 * 64 + 64 * 64 + 3 * 64) * 4);
        assert_eq!(w.backward_per_thread, (128 * 64 + 2 * 64 * 64 + 1024) * 4);
        assert_eq!((w.backward_shared, w.widened), (0, (0, 0)));
        let one = geometry((1, 1024, 1024, 64, 64), true, 0.125);
        assert_eq!(
            workspace_bytes(&one, DType::F64).backward_shared,
            7 * 1024 * 64 * 8
        );
    }
}
