//! A one-thread f32 GEMM for x86-64 cores with AVX-512, packed and blocked
//! for their caches (the Goto/BLIS scheme, with vectors along the output's
//! rows because stagecraft's matrices are row-major).
//!
//! Why our own: on the development machine (Sapphire Rapids, 2 cores) one
//! core does 214 GFLOP/s of f32 FMAs; faer's whole products reached 150
//! and MKL's 165. The micro-kernel here keeps a 14×32 tile of the product
//! in 28 registers and runs at 194 on data in L1; whole products reach
//! 160–171 on one core (B4: 1024³ and 256³), and the eager MLP step, whose
//! small and thin products faer ran slowly outside the rayon pool, went
//! from 2.37 to 1.18 ms. Every product is summed in one order that depends on `k` alone,
//! never on strides, tile positions or threads, so a transposed operand
//! read through strides, a band of rows and a whole product all give the
//! same bits, and nothing is copied to keep them equal.
//!
//! The file uses only `std`, so that `experiments/gemm-split` can include
//! it by path and measure it beside faer.

use std::arch::x86_64::*;
use std::cell::RefCell;

/// Rows of a micro-tile: each is one A value broadcast per step.
const MR: usize = 14;
/// 16-lane vectors per micro-tile row.
const NV: usize = 2;
/// Columns of a micro-tile (14×2 accumulators, 2 B vectors: 30 of the 32
/// vector registers).
const NR: usize = 16 * NV;
/// The deepest block of `k` summed in registers before the tile goes back
/// to memory: a packed A panel (`MR × KC`, 14 KiB) stays in L1 while B
/// panels stream from L2.
const KC: usize = 256;
/// Panels of A packed at a time (about 110 rows, 110 KiB).
const MC_PANELS: usize = 8;
/// Row-major A whose rows are a multiple of this many floats (4 KiB) apart
/// is packed: read in place, a panel's rows would compete for a few L1
/// sets.
const ALIASING_STRIDE: usize = 1024;
/// The widest product whose A is read in place even when its rows are
/// [`ALIASING_STRIDE`] apart: packing a panel is paid once for all of a
/// block's columns, and with few columns it costs more than the aliasing.
/// ResNet-50's last 1×1 convolutions (512×49 by 1024 or 2048 deep) ran
/// at 79–82 GFLOP/s packed, 109–112 in place; 256×196×1024 at 118 and
/// 131; no shape measured up to 1024 columns was slower in place
/// (1024³: 149 packed, 153 in place; one Xeon core, AVX-512, 2026-11-29).
const ALIASING_MAX_COLUMNS: usize = 1024;
/// The widest row-major B read without packing (floats; see `sgemm`).
const DIRECT_B_MAX_STRIDE: usize = 512;
/// Products with at most this many rows read a row-major B in place
/// whatever its row stride, as long as a block's rows span at most
/// [`DIRECT_B_MAX_SPAN`] floats: packing B costs its size once per
/// product, which few rows of A do not earn back. Measured on one Xeon
/// core (AVX-512, 2026-11-29), packed against in place, GFLOP/s:
/// 16×3025×96 77 → 118, 32×729×256 55 → 131, 64×3025×16 110 → 117,
/// 64×729×256 131 → 140; wider spans lost (48×3136×256 116 → 94,
/// 32×12321×147 106 → 75), and so did more rows (256×3136×64 146 → 135).
const DIRECT_B_MAX_ROWS: usize = 64;
/// See [`DIRECT_B_MAX_ROWS`]: 2 MiB of B's rows.
const DIRECT_B_MAX_SPAN: usize = 1 << 19;
/// Columns of B packed at a time: `KC × NC` floats is 1 MiB, half a core's
/// L2.
const NC: usize = 1024;

/// A matrix operand: element `(i, j)` is `values[i * row_stride + j *
/// col_stride]`, so a transpose is the same values with swapped strides.
/// One of the strides is 1 (row-major or transposed storage).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Matrix<'a> {
    /// The values, from element `(0, 0)` on.
    pub values: &'a [f32],
    /// Distance between rows.
    pub row_stride: usize,
    /// Distance between columns.
    pub col_stride: usize,
}

/// Whether this machine runs [`sgemm`]: at the AVX-512 level of
/// [`crate::isa::level`] (never under Miri, which has no AVX-512, nor
/// when `STAGECRAFT_CPU_ISA` lowers the level).
pub(crate) fn available() -> bool {
    crate::isa::level() == crate::isa::IsaLevel::Avx512
}

/// Packing buffers, one pair per thread, grown once and reused: a fresh
/// buffer per product would cost page faults on every call.
#[derive(Default)]
struct Packs {
    a: Vec<f32>,
    b: Vec<f32>,
}

thread_local! {
    static PACKS: RefCell<Packs> = RefCell::default();
}

/// `len` floats of `buffer` starting on a 64-byte boundary, so that no
/// vector load of a packed panel straddles two cache lines.
fn aligned(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buffer.len() < len + LANES {
        buffer.resize(len + LANES, 0.0);
    }
    let offset = buffer.as_ptr().align_offset(64).min(LANES);
    &mut buffer[offset..offset + len]
}

/// `c[m×n] = a[m×k] · b[k×n]`, `c` contiguous row-major. Panics unless
/// [`available`] (callers check it once and keep another path).
pub(crate) fn sgemm(m: usize, n: usize, k: usize, a: Matrix<'_>, b: Matrix<'_>, c: &mut [f32]) {
    assert!(available(), "sgemm needs AVX-512");
    let c = &mut c[..m * n];
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    check_extent(a, m, k);
    check_extent(b, k, n);
    if n < NR && m >= NR {
        return thin(m, n, k, a, b, c);
    }
    // Blocks of equal depth: the order of summation then depends on `k`
    // alone.
    let depth = k.div_ceil(k.div_ceil(KC));
    let panels = Panels::new(m);
    PACKS.with(|packs| {
        let packs = &mut *packs.borrow_mut();
        for (block, p0) in (0..k).step_by(depth).enumerate() {
            let kc = depth.min(k - p0);
            for j0 in (0..n).step_by(NC) {
                let nc = NC.min(n - j0);
                // Rows of B up to 2 KiB apart are read where they lie (and
                // prefetched a column panel ahead, see `Block::run`):
                // copying them costs more than it saves when A has few
                // rows, as in the MLP's bands of 64 (measured in the
                // training step: direct 0.99–1.02 ms, packed 1.01–1.04).
                // Farther apart the core's stride prefetcher loses them,
                // and B stored transposed has no row to read, so those are
                // packed.
                //
                // A product with few rows reuses a packed B for few panels
                // of A, so rows farther apart are read in place too while
                // the block's rows span little enough memory for the
                // core's TLB and L2 (the squeeze layers of SqueezeNet,
                // 16 or 32 rows by 3,025 or 729 columns).
                let direct = b.col_stride == 1
                    && (b.row_stride <= DIRECT_B_MAX_STRIDE
                        || (m <= DIRECT_B_MAX_ROWS && kc * b.row_stride <= DIRECT_B_MAX_SPAN));
                let (b_block, b_step) = if direct {
                    let first = p0 * b.row_stride + j0;
                    (&b.values[first..], b.row_stride)
                } else {
                    let packed_b = aligned(&mut packs.b, nc.next_multiple_of(NR) * kc);
                    pack_b(b, (p0, kc), (j0, nc), packed_b);
                    (&*packed_b, 0)
                };
                let block = Block {
                    kc,
                    accumulate: block > 0,
                    first_col: j0,
                    ldc: n,
                };
                let all_panels = (0..panels.count).map(|i| panels.get(i));
                if a.row_stride == 1 {
                    // Stored transposed, A's panels are read where they
                    // lie: each step's values are adjacent.
                    let a_block = &a.values[p0 * a.col_stride..];
                    let a_block = ABlock::Steps(a_block, a.col_stride);
                    block.run(all_panels, a_block, (b_block, b_step), nc, c);
                    continue;
                }
                let aliased =
                    a.row_stride.is_multiple_of(ALIASING_STRIDE) && n > ALIASING_MAX_COLUMNS;
                if a.col_stride == 1 && !aliased {
                    // Row-major, read where it lies: a broadcast from any
                    // row costs the same as from a packed panel, and
                    // packing cost 3–6 % of a product with 256 columns.
                    // Rows a multiple of 4 KiB apart share the same few L1
                    // sets, but packing them costs more than that unless
                    // the product is wide (see `ALIASING_MAX_COLUMNS`).
                    let a_block = ABlock::Rows(&a.values[p0..], a.row_stride);
                    block.run(all_panels, a_block, (b_block, b_step), nc, c);
                    continue;
                }
                for chunk in (0..panels.count).step_by(MC_PANELS) {
                    let chunk = chunk..panels.count.min(chunk + MC_PANELS);
                    let (i0, _) = panels.get(chunk.start);
                    let (last, rows) = panels.get(chunk.end - 1);
                    let packed_a = aligned(&mut packs.a, (last + rows - i0) * kc);
                    let chunk = chunk.map(|i| panels.get(i));
                    pack_a(a, chunk.clone(), (p0, kc), packed_a);
                    let relative = chunk.map(|(first, rows)| (first - i0, rows));
                    let c = &mut c[i0 * n..];
                    let a_block = ABlock::Packed(packed_a);
                    block.run(relative, a_block, (b_block, b_step), nc, c);
                }
            }
        }
    });
}

/// A product with fewer columns than a tile (the MLP's 10 classes), as
/// `cᵀ = bᵀ · aᵀ`: a tile of 10 rows uses every lane, where 10 columns of
/// 32 would waste two thirds of each vector (128×256×10 in the MLP step:
/// 26 → 17 µs).
/// Each element is the same FMAs in the same order (with the factors of
/// each product swapped, which does not change it), so the bits are those
/// of the direct product.
fn thin(m: usize, n: usize, k: usize, a: Matrix<'_>, b: Matrix<'_>, c: &mut [f32]) {
    fn swap(x: Matrix<'_>) -> Matrix<'_> {
        Matrix {
            values: x.values,
            row_stride: x.col_stride,
            col_stride: x.row_stride,
        }
    }
    let mut transposed = THIN.take();
    transposed.resize(m * n, 0.0);
    sgemm(n, m, k, swap(b), swap(a), &mut transposed);
    for (j, column) in transposed.chunks_exact(m).enumerate() {
        for (i, &value) in column.iter().enumerate() {
            c[i * n + j] = value;
        }
    }
    THIN.set(transposed);
}

thread_local! {
    /// The transposed result of a thin product, kept for the next one.
    static THIN: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Panics unless every element of a `rows × cols` operand is in bounds:
/// the packing loops below then index without further checks failing.
fn check_extent(x: Matrix<'_>, rows: usize, cols: usize) {
    assert!(
        x.row_stride == 1 || x.col_stride == 1,
        "GEMM operand with no unit stride"
    );
    let last = (rows - 1) * x.row_stride + (cols - 1) * x.col_stride;
    assert!(last < x.values.len(), "GEMM operand shorter than its shape");
}

/// Rows of A in panels of at most `MR` that differ by at most one row:
/// 128 rows are 8 panels of 13 and 2 of 12, not 9 of 14 and a slow one of
/// 2.
#[derive(Clone, Copy)]
struct Panels {
    count: usize,
    base: usize,
    extra: usize,
}

impl Panels {
    fn new(rows: usize) -> Panels {
        let count = rows.div_ceil(MR);
        Panels {
            count,
            base: rows / count,
            extra: rows % count,
        }
    }

    /// Panel `i`'s first row and rows.
    fn get(&self, i: usize) -> (usize, usize) {
        let first = i * self.base + i.min(self.extra);
        (first, self.base + usize::from(i < self.extra))
    }
}

/// Depth `p0..p0+kc` of the rows of `panels` (first row, rows) of a
/// row-major `a` (`sgemm` reads other layouts in place), packed
/// panel after panel from the first panel's row on, each depth-major:
/// step `p` of a panel of `r` rows holds its `r` values of column `p`.
fn pack_a(
    a: Matrix<'_>,
    panels: impl Iterator<Item = (usize, usize)>,
    (p0, kc): (usize, usize),
    out: &mut [f32],
) {
    assert_eq!(a.col_stride, 1, "only row-major A is packed");
    let mut panels = panels.peekable();
    let Some(&(i0, _)) = panels.peek() else {
        return;
    };
    for (first, rows) in panels {
        let out = &mut out[(first - i0) * kc..][..rows * kc];
        // 16 columns of the panel's rows at a time, turned in registers.
        let source = &a.values[first * a.row_stride + p0..];
        for p in (0..kc).step_by(LANES) {
            let cols = LANES.min(kc - p);
            let source = Strided::new(&source[p..], a.row_stride, rows, cols);
            transpose(source, &mut out[p * rows..], rows, rows);
        }
    }
}

/// Depth `p0..p0+kc`, columns `j0..j0+nc` of `b`, as panels of `NR`
/// columns, each depth-major, the last zero-padded to `NR`.
fn pack_b(b: Matrix<'_>, (p0, kc): (usize, usize), (j0, nc): (usize, usize), out: &mut [f32]) {
    if b.col_stride == 1 {
        // Row-major: B is read row after row, in the order it lies in
        // memory, so the core's streaming prefetcher runs ahead of the
        // copy (panel after panel, each row's 128 bytes would be a
        // separate miss).
        for p in 0..kc {
            let row = &b.values[(p0 + p) * b.row_stride + j0..][..nc];
            for (panel, values) in row.chunks(NR).enumerate() {
                let step = &mut out[(panel * kc + p) * NR..][..NR];
                if let Ok(values) = <&[f32; NR]>::try_from(values) {
                    // A fixed-size copy: two vector moves, not a call.
                    step.copy_from_slice(values);
                } else {
                    step[..values.len()].copy_from_slice(values);
                    step[values.len()..].fill(0.0);
                }
            }
        }
        return;
    }
    for (panel, out) in out.chunks_exact_mut(NR * kc).enumerate() {
        let first = j0 + panel * NR;
        let cols = NR.min(j0 + nc - first);
        // Stored transposed (the other unit stride): 16 columns × 16 steps
        // at a time, turned in registers; missing columns become zeros.
        for half in 0..NV {
            let start = first + half * LANES;
            let valid = cols.saturating_sub(half * LANES).min(LANES);
            for p in (0..kc).step_by(LANES) {
                let steps = LANES.min(kc - p);
                let values = if valid > 0 {
                    &b.values[p0 + p + start * b.col_stride..]
                } else {
                    &[]
                };
                let source = Strided::new(values, b.col_stride, valid, steps);
                transpose(source, &mut out[p * NR + half * LANES..], LANES, NR);
            }
        }
    }
}

/// Lanes of a vector register.
const LANES: usize = 16;

/// A block of at most 16×16 values: `rows` rows `stride` apart, `cols`
/// adjacent values each, checked to lie inside `values`.
struct Strided<'a> {
    values: &'a [f32],
    stride: usize,
    rows: usize,
    cols: usize,
}

impl<'a> Strided<'a> {
    fn new(values: &'a [f32], stride: usize, rows: usize, cols: usize) -> Strided<'a> {
        assert!(rows <= LANES && cols <= LANES);
        if rows > 0 {
            assert!((rows - 1) * stride + cols <= values.len());
        }
        Strided {
            values,
            stride,
            rows,
            cols,
        }
    }
}

/// `out[q * out_stride + r] = source(r, q)` for `q < source.cols` and
/// `r < lanes`, with zeros for rows past `source.rows`.
fn transpose(source: Strided<'_>, out: &mut [f32], lanes: usize, out_stride: usize) {
    assert!(lanes <= LANES && lanes >= source.rows);
    if source.cols == 0 {
        return;
    }
    assert!((source.cols - 1) * out_stride + lanes <= out.len());
    // SAFETY: `available()` held in `sgemm`; the reads stay inside
    // `source.values` (checked by `Strided::new`) and the writes inside
    // `out` (checked above).
    unsafe { transpose_16(source, out.as_mut_ptr(), lanes, out_stride) }
}

/// # Safety
/// AVX-512F; `out` has `(source.cols - 1) * out_stride + lanes` writable
/// floats.
#[target_feature(enable = "avx512f")]
unsafe fn transpose_16(source: Strided<'_>, out: *mut f32, lanes: usize, out_stride: usize) {
    let read = ((1u32 << source.cols) - 1) as __mmask16;
    let rows: [__m512; LANES] = std::array::from_fn(|r| {
        if r < source.rows {
            // SAFETY: row `r` of the block is inside `source.values`.
            unsafe { _mm512_maskz_loadu_ps(read, source.values.as_ptr().add(r * source.stride)) }
        } else {
            _mm512_setzero_ps()
        }
    });
    // Pairs of rows interleaved, then pairs of pairs: vector `4g + c`
    // holds, in its 128-bit lane `j`, rows `4g..4g+4` of column `c + 4j`.
    let pairs: [__m512; LANES] = std::array::from_fn(|i| {
        let (x, y) = (rows[i & !1], rows[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(x, y)
        } else {
            _mm512_unpackhi_ps(x, y)
        }
    });
    let quads: [__m512; LANES] = std::array::from_fn(|i| {
        let (g, c) = (i / 4, i % 4);
        let x = _mm512_castps_pd(pairs[4 * g + c / 2]);
        let y = _mm512_castps_pd(pairs[4 * g + c / 2 + 2]);
        _mm512_castpd_ps(if c % 2 == 0 {
            _mm512_unpacklo_pd(x, y)
        } else {
            _mm512_unpackhi_pd(x, y)
        })
    });
    let store = ((1u32 << lanes) - 1) as __mmask16;
    for c in 0..4 {
        // Lanes 0 and 2 (`EVEN`) or 1 and 3 (`ODD`) of each operand.
        const EVEN: i32 = 0b10_00_10_00;
        const ODD: i32 = 0b11_01_11_01;
        let even_low = _mm512_shuffle_f32x4::<EVEN>(quads[c], quads[4 + c]);
        let odd_low = _mm512_shuffle_f32x4::<ODD>(quads[c], quads[4 + c]);
        let even_high = _mm512_shuffle_f32x4::<EVEN>(quads[8 + c], quads[12 + c]);
        let odd_high = _mm512_shuffle_f32x4::<ODD>(quads[8 + c], quads[12 + c]);
        let columns = [
            (c, _mm512_shuffle_f32x4::<EVEN>(even_low, even_high)),
            (c + 8, _mm512_shuffle_f32x4::<ODD>(even_low, even_high)),
            (c + 4, _mm512_shuffle_f32x4::<EVEN>(odd_low, odd_high)),
            (c + 12, _mm512_shuffle_f32x4::<ODD>(odd_low, odd_high)),
        ];
        for (q, column) in columns {
            if q < source.cols {
                // SAFETY: `q < cols`, so the store is inside `out`.
                unsafe { _mm512_mask_storeu_ps(out.add(q * out_stride), store, column) }
            }
        }
    }
}

/// A block of A as a tile reads it.
#[derive(Clone, Copy)]
enum ABlock<'a> {
    /// Packed panels (see `pack_a`).
    Packed(&'a [f32]),
    /// Stored transposed: a step's rows adjacent, steps this far apart.
    Steps(&'a [f32], usize),
    /// Row-major: a row's steps adjacent, rows this far apart.
    Rows(&'a [f32], usize),
}

/// One packed block of A against one packed block of B, into `c`.
struct Block {
    kc: usize,
    /// Add to `c` (a later depth block) instead of overwriting it.
    accumulate: bool,
    /// The block's first column in `c`.
    first_col: usize,
    /// Distance between rows of `c`.
    ldc: usize,
}

impl Block {
    /// The rows of `panels` (first row, rows: in `c` and in `a`) against
    /// `nc` columns of `b`; `b` is a packed block (`b_step` 0) or row-major
    /// rows `b_step` apart.
    fn run(
        &self,
        panels: impl Iterator<Item = (usize, usize)>,
        a_block: ABlock<'_>,
        (b, b_step): (&[f32], usize),
        nc: usize,
        c: &mut [f32],
    ) {
        let kc = self.kc;
        // Each A panel stays in L1 while every B panel of the block passes
        // it; the B block stays in L2 across A panels.
        for (index, (first_row, rows)) in panels.enumerate() {
            // B read where it lies comes from L3 or memory on the first
            // panel's pass (in a training step it was last touched a
            // kernel ago): each column panel is prefetched while the one
            // before it is multiplied (the MLP's first layer: 268 → 248 µs).
            if index == 0 && b_step != 0 {
                prefetch_columns(b, b_step, kc, 0, nc);
            }
            // (values, distance between steps, distance between rows)
            let (a, a_step, a_row) = match a_block {
                ABlock::Packed(values) => (&values[first_row * kc..][..rows * kc], rows, 1),
                ABlock::Steps(values, step) => {
                    let a = &values[first_row..];
                    assert!((kc - 1) * step + rows <= a.len());
                    (a, step, 1)
                }
                ABlock::Rows(values, stride) => {
                    let a = &values[first_row * stride..];
                    assert!((rows - 1) * stride + kc <= a.len());
                    (a, 1, stride)
                }
            };
            for column_panel in 0..nc.div_ceil(NR) {
                let cols = NR.min(nc - column_panel * NR);
                if index == 0 && b_step != 0 {
                    prefetch_columns(b, b_step, kc, column_panel + 1, nc);
                }
                let (b, b_step) = if b_step == 0 {
                    (&b[column_panel * NR * kc..][..NR * kc], NR)
                } else {
                    let b = &b[column_panel * NR..];
                    assert!((kc - 1) * b_step + cols <= b.len());
                    (b, b_step)
                };
                let first = first_row * self.ldc + self.first_col + column_panel * NR;
                let last = first + (rows - 1) * self.ldc + cols;
                assert!(last <= c.len());
                // SAFETY: `available()` held in `sgemm`, so the CPU has
                // AVX-512F. The tile reads `rows` values, `a_row` apart,
                // at each of `kc` steps of `a`, `a_step` apart, and `cols`
                // values at each of `kc` steps of `b`, `b_step` apart (all
                // extents checked above), and reads and writes `cols`
                // values in each of `rows` rows of `c` from `first` on,
                // `ldc` apart: in bounds by the assertion above. Columns
                // past `cols` are masked off.
                unsafe {
                    TILES[rows - 1](
                        kc,
                        (a.as_ptr(), a_step, a_row),
                        (b.as_ptr(), b_step),
                        (c.as_mut_ptr().add(first), self.ldc),
                        cols,
                        self.accumulate,
                    )
                }
            }
        }
    }
}

/// Asks for column panel `column_panel` of a row-major B block (rows
/// `b_step` apart) to be brought into L2, ahead of the tiles that read it:
/// rows read where they lie are far apart, and without this each of their
/// first reads waits for memory in turn.
fn prefetch_columns(b: &[f32], b_step: usize, kc: usize, column_panel: usize, nc: usize) {
    let first = column_panel * NR;
    if first >= nc {
        return;
    }
    let last = NR.min(nc - first) - 1;
    for p in 0..kc {
        let row = b.as_ptr().wrapping_add(p * b_step + first) as *const i8;
        // SAFETY: `available()` held in `sgemm`; a prefetch never faults,
        // whatever the address.
        unsafe {
            _mm_prefetch::<_MM_HINT_T1>(row);
            _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(4 * last));
        }
    }
}

/// A read-only operand of a tile: first value, and distance between steps.
type Steps = (*const f32, usize);

/// A's values in a tile: first value, distance between steps, distance
/// between rows.
type AValues = (*const f32, usize, usize);

type Tile = unsafe fn(usize, AValues, Steps, (*mut f32, usize), usize, bool);

/// The micro-kernel for each panel height, 1..=MR rows.
const TILES: [Tile; MR] = [
    tile::<1>, tile::<2>, tile::<3>, tile::<4>, tile::<5>, tile::<6>, tile::<7>, tile::<8>,
    tile::<9>, tile::<10>, tile::<11>, tile::<12>, tile::<13>, tile::<14>,
];

/// The inner loop of a full tile (all `NR` columns) of `R` rows, written
/// in assembly: compiled from intrinsics the same loop ran at 85% of the
/// core's FMA peak and this one at 91% (a masked load of B, which the
/// compiler needs for partial tiles, cost most of the difference). Each
/// step loads one row of B into zmm0–1, broadcasts each of the panel's `R`
/// values of A into zmm2 and multiplies-adds into the row's accumulators
/// (zmm4 on, two per row).
macro_rules! full_tile_loop {
    ($name:ident: $( ($offset:literal, $low:literal, $high:literal) )+) => {
        /// # Safety
        /// As [`tile`]'s, with `kc` ≥ 1 and all `NR` columns of `b`
        /// readable at each step.
        #[target_feature(enable = "avx512f")]
        unsafe fn $name(
            kc: usize,
            a: *const f32,
            a_step: usize,
            b: *const f32,
            b_step: usize,
        ) -> [[__m512; NV]; MR] {
            let mut acc = [[_mm512_setzero_ps(); NV]; MR];
            // SAFETY: the loop reads `R` floats of `a` and `NR` of `b` at
            // each of `kc` steps, readable by the caller's contract; it
            // writes only the registers named below.
            unsafe {
                std::arch::asm!(
                    "2:",
                    "vmovups zmm0, [{b}]",
                    "vmovups zmm1, [{b} + 64]",
                    $(
                        concat!("vbroadcastss zmm2, dword ptr [{a} + ", $offset, "]"),
                        concat!("vfmadd231ps zmm", $low, ", zmm2, zmm0"),
                        concat!("vfmadd231ps zmm", $high, ", zmm2, zmm1"),
                    )+
                    "add {a}, {a_step}",
                    "add {b}, {b_step}",
                    "dec {k}",
                    "jnz 2b",
                    a = inout(reg) a => _,
                    b = inout(reg) b => _,
                    k = inout(reg) kc => _,
                    a_step = in(reg) a_step * 4,
                    b_step = in(reg) b_step * 4,
                    out("zmm0") _,
                    out("zmm1") _,
                    out("zmm2") _,
                    inout("zmm4") acc[0][0], inout("zmm5") acc[0][1],
                    inout("zmm6") acc[1][0], inout("zmm7") acc[1][1],
                    inout("zmm8") acc[2][0], inout("zmm9") acc[2][1],
                    inout("zmm10") acc[3][0], inout("zmm11") acc[3][1],
                    inout("zmm12") acc[4][0], inout("zmm13") acc[4][1],
                    inout("zmm14") acc[5][0], inout("zmm15") acc[5][1],
                    inout("zmm16") acc[6][0], inout("zmm17") acc[6][1],
                    inout("zmm18") acc[7][0], inout("zmm19") acc[7][1],
                    inout("zmm20") acc[8][0], inout("zmm21") acc[8][1],
                    inout("zmm22") acc[9][0], inout("zmm23") acc[9][1],
                    inout("zmm24") acc[10][0], inout("zmm25") acc[10][1],
                    inout("zmm26") acc[11][0], inout("zmm27") acc[11][1],
                    inout("zmm28") acc[12][0], inout("zmm29") acc[12][1],
                    inout("zmm30") acc[13][0], inout("zmm31") acc[13][1],
                    options(nostack, readonly),
                );
            }
            acc
        }
    };
}

full_tile_loop!(full_tile_loop_1:
    (0, "4", "5")
);
full_tile_loop!(full_tile_loop_2:
    (0, "4", "5") (4, "6", "7")
);
full_tile_loop!(full_tile_loop_3:
    (0, "4", "5") (4, "6", "7") (8, "8", "9")
);
full_tile_loop!(full_tile_loop_4:
    (0, "4", "5") (4, "6", "7") (8, "8", "9") (12, "10", "11")
);
full_tile_loop!(full_tile_loop_5:
    (0, "4", "5") (4, "6", "7") (8, "8", "9") (12, "10", "11") (16, "12", "13")
);
full_tile_loop!(full_tile_loop_6:
    (0, "4", "5") (4, "6", "7") (8, "8", "9") (12, "10", "11") (16, "12", "13")
    (20, "14", "15")
);
full_tile_loop!(full_tile_loop_7:
    (0, "4", "5") (4, "6", "7") (8, "8", "9") (12, "10", "11") (16, "12", "13")
    (20, "14", "15") (24, "16", "17")
);
full_tile_loop!(full_tile_loop_8:
    (0, "4", "5") (4, "6", "7") (8, "8", "9") (12, "10", "11") (16, "12", "13")
    (20, "14", "15") (24, "16", "17") (28, "18", "19")
);
full_tile_loop!(full_tile_loop_9:
    (0, "4", "5") (4, "6", "7") (8, "8", "9") (12, "10", "11") (16, "12", "13")
    (20, "14", "15") (24, "16", "17") (28, "18", "19") (32, "20", "21")
);
full_tile_loop!(full_tile_loop_10:
    (0, "4", "5") (4, "6", "7") (8, "8", "9") (12, "10", "11") (16, "12", "13")
    (20, "14", "15") (24, "16", "17") (28, "18", "19") (32, "20", "21") (36, "22", "23")
);
full_tile_loop!(full_tile_loop_11:
    (0, "4", "5") (4, "6", "7") (8, "8", "9") (12, "10", "11") (16, "12", "13")
    (20, "14", "15") (24, "16", "17") (28, "18", "19") (32, "20", "21") (36, "22", "23")
    (40, "24", "25")
);
full_tile_loop!(full_tile_loop_12:
    (0, "4", "5") (4, "6", "7") (8, "8", "9") (12, "10", "11") (16, "12", "13")
    (20, "14", "15") (24, "16", "17") (28, "18", "19") (32, "20", "21") (36, "22", "23")
    (40, "24", "25") (44, "26", "27")
);
full_tile_loop!(full_tile_loop_13:
    (0, "4", "5") (4, "6", "7") (8, "8", "9") (12, "10", "11") (16, "12", "13")
    (20, "14", "15") (24, "16", "17") (28, "18", "19") (32, "20", "21") (36, "22", "23")
    (40, "24", "25") (44, "26", "27") (48, "28", "29")
);
full_tile_loop!(full_tile_loop_14:
    (0, "4", "5") (4, "6", "7") (8, "8", "9") (12, "10", "11") (16, "12", "13")
    (20, "14", "15") (24, "16", "17") (28, "18", "19") (32, "20", "21") (36, "22", "23")
    (40, "24", "25") (44, "26", "27") (48, "28", "29") (52, "30", "31")
);

/// The full-tile inner loop for each panel height, 1..=MR rows.
const FULL_TILE_LOOPS: [FullTileLoop; MR] = [
    full_tile_loop_1,
    full_tile_loop_2,
    full_tile_loop_3,
    full_tile_loop_4,
    full_tile_loop_5,
    full_tile_loop_6,
    full_tile_loop_7,
    full_tile_loop_8,
    full_tile_loop_9,
    full_tile_loop_10,
    full_tile_loop_11,
    full_tile_loop_12,
    full_tile_loop_13,
    full_tile_loop_14,
];

type FullTileLoop = unsafe fn(usize, *const f32, usize, *const f32, usize) -> [[__m512; NV]; MR];

/// [`full_tile_loop`] for A read in place, row-major: row `r`'s value at
/// each step is at `a + r * stride`, addressed from five row pointers
/// (rows 0, 3, 6, 9, 12) plus the stride scaled by 1, 2, 4 or 8, all five
/// moving on by one float per step. Measured in the same loop: as fast as
/// broadcasts from a packed panel. One macro for both layouts (its loop
/// naming every pointer of either) measured 1–3 % slower on whole
/// products, so the two keep separate operand lists.
macro_rules! row_major_tile_loop {
    ($name:ident: $( ($address:literal, $low:literal, $high:literal) )+) => {
        /// # Safety
        /// As [`tile`]'s, with `kc` ≥ 1, `a_step` 1 and all `NR` columns
        /// of `b` readable at each step.
        #[target_feature(enable = "avx512f")]
        unsafe fn $name(
            kc: usize,
            a: *const f32,
            stride: usize,
            b: *const f32,
            b_step: usize,
        ) -> [[__m512; NV]; MR] {
            let mut acc = [[_mm512_setzero_ps(); NV]; MR];
            let row = |r: usize| a.wrapping_add(r * stride);
            // SAFETY: the loop reads `R` floats of `a`, `stride` apart, and
            // `NR` of `b` at each of `kc` steps, readable by the caller's
            // contract (rows past `R` are named but never read); it writes
            // only the registers named below.
            unsafe {
                std::arch::asm!(
                    // Short panels leave some row pointers unread.
                    "/* {a3} {a6} {a9} {a12} {l} */",
                    "2:",
                    "vmovups zmm0, [{b}]",
                    "vmovups zmm1, [{b} + 64]",
                    $(
                        concat!("vbroadcastss zmm2, dword ptr [", $address, "]"),
                        concat!("vfmadd231ps zmm", $low, ", zmm2, zmm0"),
                        concat!("vfmadd231ps zmm", $high, ", zmm2, zmm1"),
                    )+
                    "add {a0}, 4",
                    "add {a3}, 4",
                    "add {a6}, 4",
                    "add {a9}, 4",
                    "add {a12}, 4",
                    "add {b}, {b_step}",
                    "dec {k}",
                    "jnz 2b",
                    a0 = inout(reg) row(0) => _,
                    a3 = inout(reg) row(3) => _,
                    a6 = inout(reg) row(6) => _,
                    a9 = inout(reg) row(9) => _,
                    a12 = inout(reg) row(12) => _,
                    l = in(reg) stride * 4,
                    b = inout(reg) b => _,
                    k = inout(reg) kc => _,
                    b_step = in(reg) b_step * 4,
                    out("zmm0") _,
                    out("zmm1") _,
                    out("zmm2") _,
                    inout("zmm4") acc[0][0], inout("zmm5") acc[0][1],
                    inout("zmm6") acc[1][0], inout("zmm7") acc[1][1],
                    inout("zmm8") acc[2][0], inout("zmm9") acc[2][1],
                    inout("zmm10") acc[3][0], inout("zmm11") acc[3][1],
                    inout("zmm12") acc[4][0], inout("zmm13") acc[4][1],
                    inout("zmm14") acc[5][0], inout("zmm15") acc[5][1],
                    inout("zmm16") acc[6][0], inout("zmm17") acc[6][1],
                    inout("zmm18") acc[7][0], inout("zmm19") acc[7][1],
                    inout("zmm20") acc[8][0], inout("zmm21") acc[8][1],
                    inout("zmm22") acc[9][0], inout("zmm23") acc[9][1],
                    inout("zmm24") acc[10][0], inout("zmm25") acc[10][1],
                    inout("zmm26") acc[11][0], inout("zmm27") acc[11][1],
                    inout("zmm28") acc[12][0], inout("zmm29") acc[12][1],
                    inout("zmm30") acc[13][0], inout("zmm31") acc[13][1],
                    options(nostack, readonly),
                );
            }
            acc
        }
    };
}

row_major_tile_loop!(row_major_tile_loop_1:
    ("{a0}", "4", "5")
);
row_major_tile_loop!(row_major_tile_loop_2:
    ("{a0}", "4", "5") ("{a0} + {l}", "6", "7")
);
row_major_tile_loop!(row_major_tile_loop_3:
    ("{a0}", "4", "5") ("{a0} + {l}", "6", "7") ("{a0} + {l}*2", "8", "9")
);
row_major_tile_loop!(row_major_tile_loop_4:
    ("{a0}", "4", "5") ("{a0} + {l}", "6", "7") ("{a0} + {l}*2", "8", "9")
    ("{a3}", "10", "11")
);
row_major_tile_loop!(row_major_tile_loop_5:
    ("{a0}", "4", "5") ("{a0} + {l}", "6", "7") ("{a0} + {l}*2", "8", "9")
    ("{a3}", "10", "11") ("{a0} + {l}*4", "12", "13")
);
row_major_tile_loop!(row_major_tile_loop_6:
    ("{a0}", "4", "5") ("{a0} + {l}", "6", "7") ("{a0} + {l}*2", "8", "9")
    ("{a3}", "10", "11") ("{a0} + {l}*4", "12", "13") ("{a3} + {l}*2", "14", "15")
);
row_major_tile_loop!(row_major_tile_loop_7:
    ("{a0}", "4", "5") ("{a0} + {l}", "6", "7") ("{a0} + {l}*2", "8", "9")
    ("{a3}", "10", "11") ("{a0} + {l}*4", "12", "13") ("{a3} + {l}*2", "14", "15")
    ("{a6}", "16", "17")
);
row_major_tile_loop!(row_major_tile_loop_8:
    ("{a0}", "4", "5") ("{a0} + {l}", "6", "7") ("{a0} + {l}*2", "8", "9")
    ("{a3}", "10", "11") ("{a0} + {l}*4", "12", "13") ("{a3} + {l}*2", "14", "15")
    ("{a6}", "16", "17") ("{a3} + {l}*4", "18", "19")
);
row_major_tile_loop!(row_major_tile_loop_9:
    ("{a0}", "4", "5") ("{a0} + {l}", "6", "7") ("{a0} + {l}*2", "8", "9")
    ("{a3}", "10", "11") ("{a0} + {l}*4", "12", "13") ("{a3} + {l}*2", "14", "15")
    ("{a6}", "16", "17") ("{a3} + {l}*4", "18", "19") ("{a0} + {l}*8", "20", "21")
);
row_major_tile_loop!(row_major_tile_loop_10:
    ("{a0}", "4", "5") ("{a0} + {l}", "6", "7") ("{a0} + {l}*2", "8", "9")
    ("{a3}", "10", "11") ("{a0} + {l}*4", "12", "13") ("{a3} + {l}*2", "14", "15")
    ("{a6}", "16", "17") ("{a3} + {l}*4", "18", "19") ("{a0} + {l}*8", "20", "21")
    ("{a9}", "22", "23")
);
row_major_tile_loop!(row_major_tile_loop_11:
    ("{a0}", "4", "5") ("{a0} + {l}", "6", "7") ("{a0} + {l}*2", "8", "9")
    ("{a3}", "10", "11") ("{a0} + {l}*4", "12", "13") ("{a3} + {l}*2", "14", "15")
    ("{a6}", "16", "17") ("{a3} + {l}*4", "18", "19") ("{a0} + {l}*8", "20", "21")
    ("{a9}", "22", "23") ("{a6} + {l}*4", "24", "25")
);
row_major_tile_loop!(row_major_tile_loop_12:
    ("{a0}", "4", "5") ("{a0} + {l}", "6", "7") ("{a0} + {l}*2", "8", "9")
    ("{a3}", "10", "11") ("{a0} + {l}*4", "12", "13") ("{a3} + {l}*2", "14", "15")
    ("{a6}", "16", "17") ("{a3} + {l}*4", "18", "19") ("{a0} + {l}*8", "20", "21")
    ("{a9}", "22", "23") ("{a6} + {l}*4", "24", "25") ("{a3} + {l}*8", "26", "27")
);
row_major_tile_loop!(row_major_tile_loop_13:
    ("{a0}", "4", "5") ("{a0} + {l}", "6", "7") ("{a0} + {l}*2", "8", "9")
    ("{a3}", "10", "11") ("{a0} + {l}*4", "12", "13") ("{a3} + {l}*2", "14", "15")
    ("{a6}", "16", "17") ("{a3} + {l}*4", "18", "19") ("{a0} + {l}*8", "20", "21")
    ("{a9}", "22", "23") ("{a6} + {l}*4", "24", "25") ("{a3} + {l}*8", "26", "27")
    ("{a12}", "28", "29")
);
row_major_tile_loop!(row_major_tile_loop_14:
    ("{a0}", "4", "5") ("{a0} + {l}", "6", "7") ("{a0} + {l}*2", "8", "9")
    ("{a3}", "10", "11") ("{a0} + {l}*4", "12", "13") ("{a3} + {l}*2", "14", "15")
    ("{a6}", "16", "17") ("{a3} + {l}*4", "18", "19") ("{a0} + {l}*8", "20", "21")
    ("{a9}", "22", "23") ("{a6} + {l}*4", "24", "25") ("{a3} + {l}*8", "26", "27")
    ("{a12}", "28", "29") ("{a9} + {l}*4", "30", "31")
);

/// The full-tile inner loop over row-major A for each panel height.
const ROW_MAJOR_TILE_LOOPS: [FullTileLoop; MR] = [
    row_major_tile_loop_1,
    row_major_tile_loop_2,
    row_major_tile_loop_3,
    row_major_tile_loop_4,
    row_major_tile_loop_5,
    row_major_tile_loop_6,
    row_major_tile_loop_7,
    row_major_tile_loop_8,
    row_major_tile_loop_9,
    row_major_tile_loop_10,
    row_major_tile_loop_11,
    row_major_tile_loop_12,
    row_major_tile_loop_13,
    row_major_tile_loop_14,
];

/// `c[R×cols] (+)= a[R×kc] · b[kc×NR]`, the product held in registers.
///
/// # Safety
/// The CPU has AVX-512F; `a` has `R` readable floats, `a_row` apart, at
/// each of `kc` steps `a_step` apart, `b` has `cols` (≤ `NR`) at each of `kc` steps `b_step`
/// apart; `c` has `cols` writable floats at each of `R` rows `ldc` apart.
#[target_feature(enable = "avx512f")]
unsafe fn tile<const R: usize>(
    kc: usize,
    (a, a_step, a_row): AValues,
    (b, b_step): Steps,
    (c, ldc): (*mut f32, usize),
    cols: usize,
    accumulate: bool,
) {
    let masks: [__mmask16; NV] = std::array::from_fn(|v| {
        let lanes = cols.saturating_sub(16 * v).min(16);
        ((1u32 << lanes) - 1) as __mmask16
    });
    // The tile's rows of `c` start coming into L1 now, so the loads and
    // stores after the loop do not wait on L2 or L3 (a prefetch never
    // faults).
    for i in 0..R {
        let row = c.wrapping_add(i * ldc) as *const i8;
        _mm_prefetch::<_MM_HINT_T0>(row);
        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(4 * NR - 4));
    }
    if cols == NR {
        // SAFETY: all `NR` columns are readable (`cols == NR`) and `kc`
        // is at least 1 (`sgemm` returns early for `k == 0`).
        let full = unsafe {
            if a_row == 1 {
                FULL_TILE_LOOPS[R - 1](kc, a, a_step, b, b_step)
            } else {
                ROW_MAJOR_TILE_LOOPS[R - 1](kc, a, a_row, b, b_step)
            }
        };
        let acc: [[__m512; NV]; R] = std::array::from_fn(|i| full[i]);
        // SAFETY: as this function's contract.
        return unsafe { store_tile(acc, c, ldc, cols, accumulate) };
    }
    let mut acc = [[_mm512_setzero_ps(); NV]; R];
    let step = |acc: &mut [[__m512; NV]; R], p: usize| {
        // SAFETY: (for the whole block) `p < kc`, so by the contract above
        // the `R` values of `a` and the unmasked lanes of `b` at step `p`
        // are readable; the CPU has AVX-512F.
        unsafe {
            let row = b.add(p * b_step);
            let bv: [__m512; NV] =
                std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], row.add(16 * v)));
            for (i, acc) in acc.iter_mut().enumerate() {
                let ai = _mm512_set1_ps(*a.add(p * a_step + i * a_row));
                for v in 0..NV {
                    acc[v] = _mm512_fmadd_ps(ai, bv[v], acc[v]);
                }
            }
        }
    };
    const UNROLL: usize = 4;
    let whole = kc / UNROLL * UNROLL;
    let mut p = 0;
    while p < whole {
        for u in 0..UNROLL {
            step(&mut acc, p + u);
        }
        p += UNROLL;
    }
    for p in whole..kc {
        step(&mut acc, p);
    }
    // SAFETY: as this function's contract.
    unsafe { store_tile(acc, c, ldc, cols, accumulate) }
}

/// `c[R×cols] = acc` or `c[R×cols] += acc`.
///
/// # Safety
/// AVX-512F; `c` has `cols` (≤ `NR`) writable floats at each of `R` rows
/// `ldc` apart.
#[target_feature(enable = "avx512f")]
unsafe fn store_tile<const R: usize>(
    acc: [[__m512; NV]; R],
    c: *mut f32,
    ldc: usize,
    cols: usize,
    accumulate: bool,
) {
    for (i, acc) in acc.iter().enumerate() {
        for (v, &sum) in acc.iter().enumerate() {
            let lanes = cols.saturating_sub(16 * v).min(16);
            if lanes == 0 {
                continue;
            }
            let mask = ((1u32 << lanes) - 1) as __mmask16;
            // SAFETY: lanes past `cols` are masked off, and masked lanes
            // are neither read nor written (AVX-512 suppresses their
            // faults); the rest are in bounds by the caller's contract.
            unsafe {
                let out = c.add(i * ldc + 16 * v);
                let value = if accumulate {
                    _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out), sum)
                } else {
                    sum
                };
                _mm512_mask_storeu_ps(out, mask, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A `rows × cols` matrix with entries of mixed sign and magnitude,
    /// stored row-major or transposed.
    fn operand(rows: usize, cols: usize, transposed: bool, seed: u32) -> (Vec<f32>, usize, usize) {
        let value = |i: usize, j: usize| {
            let h = (i as u32).wrapping_mul(2_654_435_761) ^ (j as u32).wrapping_mul(40_503) ^ seed;
            ((h % 2001) as f32 - 1000.0) / 997.0
        };
        let mut values = vec![0.0; rows * cols];
        for i in 0..rows {
            for j in 0..cols {
                let at = if transposed {
                    j * rows + i
                } else {
                    i * cols + j
                };
                values[at] = value(i, j);
            }
        }
        let (row_stride, col_stride) = if transposed { (1, rows) } else { (cols, 1) };
        (values, row_stride, col_stride)
    }

    fn matrix(x: &(Vec<f32>, usize, usize)) -> Matrix<'_> {
        Matrix {
            values: &x.0,
            row_stride: x.1,
            col_stride: x.2,
        }
    }

    /// Runs `(m, n, k)` with every layout of `a` and `b`, checks each
    /// against an f64 product, and checks that every layout, and every
    /// band of rows run on its own, gives the bits of the row-major run.
    fn check(m: usize, n: usize, k: usize) {
        let mut first: Option<Vec<f32>> = None;
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let a = operand(m, k, ta, 1);
            let b = operand(k, n, tb, 2);
            let mut c = vec![f32::NAN; m * n];
            sgemm(m, n, k, matrix(&a), matrix(&b), &mut c);
            let (ma, mb) = (matrix(&a), matrix(&b));
            let at =
                |x: Matrix<'_>, i: usize, j: usize| x.values[i * x.row_stride + j * x.col_stride];
            for i in 0..m {
                for j in 0..n {
                    let (mut exact, mut scale) = (0f64, 0f64);
                    for p in 0..k {
                        let term = f64::from(at(ma, i, p)) * f64::from(at(mb, p, j));
                        exact += term;
                        scale += term.abs();
                    }
                    let got = f64::from(c[i * n + j]);
                    let bound = 1e-6 * (k as f64) * scale + 1e-30;
                    assert!(
                        (got - exact).abs() <= bound,
                        "{m}×{n}×{k} ({ta}, {tb}) at ({i}, {j}): {got} vs {exact}"
                    );
                }
            }
            match &first {
                None => first = Some(c.clone()),
                Some(want) => assert!(
                    want.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{m}×{n}×{k}: layout ({ta}, {tb}) changed the bits"
                ),
            }
            // Rows `split..` on their own, as a thread's band would be.
            let split = m / 3;
            let rows = m - split;
            let mut band = vec![f32::NAN; rows * n];
            let a_band = Matrix {
                values: &a.0[split * a.1..],
                ..matrix(&a)
            };
            sgemm(rows, n, k, a_band, matrix(&b), &mut band);
            assert!(
                band.iter()
                    .zip(&c[split * n..])
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{m}×{n}×{k} ({ta}, {tb}): a band of rows changed the bits"
            );
        }
    }

    #[test]
    fn products_match_f64_and_keep_their_bits_across_layouts_and_bands() {
        if !available() {
            eprintln!("no AVX-512 here: the kernel is not used, nothing to test");
            return;
        }
        // Single elements; tile edges (14 rows, 32 columns, 16-lane
        // transposes); depths past one block (256) with uneven blocks;
        // widths past one packed block of B (1024) and row strides past
        // the direct-read limit (512), read in place with few rows of A
        // and packed with more rows or a wider span; rows of A 4 KiB apart
        // (packed, not read in place); the MLP's thin products.
        for (m, n, k) in [
            (1, 1, 1),
            (3, 5, 7),
            (14, 32, 16),
            (15, 33, 17),
            (28, 64, 256),
            (29, 31, 257),
            (40, 17, 600),
            (20, 64, 1024),
            (13, 1030, 20),
            (20, 600, 30),
            (70, 600, 30),
            (20, 5000, 256),
            (128, 10, 256),
            (128, 256, 10),
        ] {
            check(m, n, k);
        }
    }

    #[test]
    fn empty_products_write_nothing_or_zeros() {
        if !available() {
            return;
        }
        let mut c = vec![7.0f32; 6];
        let a = operand(2, 0, false, 1);
        let b = operand(0, 3, false, 2);
        sgemm(2, 3, 0, matrix(&a), matrix(&b), &mut c);
        assert_eq!(c, [0.0; 6]);
        let mut untouched = vec![7.0f32; 4];
        sgemm(
            0,
            3,
            4,
            matrix(&operand(0, 4, false, 1)),
            matrix(&operand(4, 3, false, 2)),
            &mut untouched,
        );
        assert_eq!(untouched, [7.0; 4]);
    }

    #[test]
    fn nan_and_infinity_propagate() {
        if !available() {
            return;
        }
        let a = (vec![f32::NAN, 1.0, 2.0, f32::INFINITY], 2, 1);
        let b = (vec![1.0, 0.0, 1.0, 1.0], 2, 1);
        let mut c = vec![0.0f32; 4];
        sgemm(2, 2, 2, matrix(&a), matrix(&b), &mut c);
        assert!(c[0].is_nan() && c[1].is_nan());
        assert_eq!(c[2..], [f32::INFINITY, f32::INFINITY]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn random_shapes_match_f64(m in 1usize..48, n in 1usize..80, k in 1usize..300) {
            if available() {
                check(m, n, k);
            }
        }
    }
}
