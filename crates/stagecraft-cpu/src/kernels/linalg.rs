//! Matrix multiplication: batched, with broadcast batch dimensions, on a
//! fast GEMM for floats and plain loops for integers.

use crate::kernel::{Kernel, KernelContext, KernelRegistry, Outputs};
use crate::numeric::broadcast_strides;
use crate::Inputs;
use half::{bf16, f16};
use smallvec::smallvec;
use stagecraft_ops::{matmul_operand, matmul_shapes, matmul_transposes, Attrs};
use stagecraft_tensor::{
    Buffer, DType, DenseHostTensor, Element, Error, Result, Shape, TensorMetadata,
};
use std::sync::Arc;

pub(crate) fn register(registry: &mut KernelRegistry) {
    registry.add(&stagecraft_ops::MATMUL, matmul_factory);
}

/// Products of at most this many multiply-adds run on one thread:
/// forking costs more than it saves. Measured on 2 threads with the pool
/// awake: 64³ takes 3.9 µs on one thread and 4.3 split, 128×32×96 5.8 and
/// 5.1, and the MLP's 128×256×10 products 9.8 and 7.0 (in its training
/// step, each thread then reads the rows of the activations its own core
/// wrote).
const GEMM_PARALLEL_FLOPS: usize = 64 * 64 * 64;

/// faer's products (f64, and f32 without AVX-512) split from this many
/// multiply-adds on: [`GEMM_PARALLEL_FLOPS`] was measured on the own
/// kernel only, and faer's 64³ was slower on two threads.
const FAER_PARALLEL_FLOPS: usize = 128 * 128 * 128;

/// A batch of products with this much work in all, each with less than 8
/// times this, runs an item per task rather than splitting each item.
const BATCH_SPLIT_FLOPS: usize = 128 * 128 * 128;

/// Whether a product is large enough to split over threads.
fn worth_splitting(m: usize, n: usize, k: usize) -> bool {
    m.saturating_mul(n).saturating_mul(k) > GEMM_PARALLEL_FLOPS
}

/// Products split into row bands when every thread gets at least this many
/// rows; thinner products use faer's own parallel split.
const GEMM_MIN_PANEL_ROWS: usize = 16;

/// Products at least this deep whose output has at most
/// [`HALVED_MAX_OUTPUT`] elements are summed as two halves of their depth
/// (see [`halved`]).
const HALVED_MIN_DEPTH: usize = 768;

/// See [`HALVED_MIN_DEPTH`]: larger outputs give every thread a band of
/// rows big enough to keep the right operand's reads worthwhile.
const HALVED_MAX_OUTPUT: usize = 1 << 16;

/// Halved products add their halves on several threads from this many
/// output elements on.
const HALVED_PARALLEL_ADD: usize = 4096;

/// Transposed operands are read through strides only when the product has
/// at least this many rows and columns (see `GemmElement::gemm`). Measured:
/// with both at 16 or more, strided and copied operands give the same bits
/// for every size tried (m, n in 16..256, k in 1..1000, serial and banded).
const STRIDED_MIN_DIM: usize = 16;

/// How a GEMM operand is stored: as the matrix it stands for, or as its
/// transpose (the matmul's `transpose_a`/`transpose_b`), read with swapped
/// strides instead of copied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    AsIs,
    Transposed,
}

impl Layout {
    fn of(transposed: bool) -> Layout {
        if transposed {
            Layout::Transposed
        } else {
            Layout::AsIs
        }
    }
}

/// A `rows × cols` row-major matrix, or the transpose of one stored as
/// `cols × rows`, as faer sees it.
fn view<T: faer::traits::ComplexField>(
    values: &[T],
    rows: usize,
    cols: usize,
    layout: Layout,
) -> faer::MatRef<'_, T> {
    match layout {
        Layout::AsIs => faer::MatRef::from_row_major_slice(&values[..rows * cols], rows, cols),
        Layout::Transposed => {
            faer::MatRef::from_row_major_slice(&values[..rows * cols], cols, rows).transpose()
        }
    }
}

/// Work done on a finished stretch of a product while it is still in cache
/// (a fused kernel's bias and activation): called with the stretch's first
/// element (counted from the start of the product) and its values, on the
/// thread that computed them. `may_split` says whether it may fork the work
/// onto the pool (not when it is one band of a product already split).
pub(crate) type Epilogue<'a, T> = &'a (dyn Fn(usize, &mut [T], bool) + Sync);

/// An [`Epilogue`] that leaves the product as it is.
pub(crate) fn no_epilogue<T>(_: usize, _: &mut [T], _: bool) {}

/// A matrix operand of an own kernel: element `(i, j)` at `i * row_stride
/// + j * col_stride`.
#[derive(Clone, Copy)]
pub(crate) struct Strided<'a, T> {
    values: &'a [T],
    row_stride: usize,
    col_stride: usize,
}

impl<'a, T> Strided<'a, T> {
    /// A `rows × cols` matrix stored as `layout` says.
    fn new(values: &'a [T], rows: usize, cols: usize, layout: Layout) -> Strided<'a, T> {
        let (row_stride, col_stride) = match layout {
            Layout::AsIs => (cols, 1),
            Layout::Transposed => (1, rows),
        };
        Strided {
            values,
            row_stride,
            col_stride,
        }
    }

    /// The matrix from element `(row, col)` on.
    fn from(self, row: usize, col: usize) -> Strided<'a, T> {
        let first = row * self.row_stride + col * self.col_stride;
        Strided {
            values: &self.values[first..],
            ..self
        }
    }
}

/// A GEMM kernel of stagecraft's own for one element type on this machine
/// (f32 on AVX-512, see `sgemm.rs`): `c[m×n] = A · B` on the calling
/// thread, `c` contiguous row-major.
type OwnGemm<T> = fn((usize, usize, usize), Strided<'_, T>, Strided<'_, T>, &mut [T]);

/// Element types with a fast GEMM: stagecraft's own where it has one for
/// the machine, else faer (chosen by measurement on these machines — as
/// fast as OpenBLAS at large sizes, about 10× less overhead than the `gemm`
/// crate on tiny products, and no system dependency).
pub(crate) trait GemmElement: Element + faer::traits::ComplexField {
    /// `c[m×n] = A[m×k] · B[k×n]`, `c` contiguous row-major, `a` and `b`
    /// stored as their layouts say; then `epilogue` over `c`, band by band
    /// where the product is split into bands.
    fn gemm(
        (m, n, k): (usize, usize, usize),
        (a, a_layout): (&[Self], Layout),
        (b, b_layout): (&[Self], Layout),
        c: &mut [Self],
        parallel: bool,
        epilogue: Epilogue<'_, Self>,
    ) {
        if let Some(own) = Self::own_gemm() {
            return own_gemm_split(
                own,
                (m, n, k),
                (a, a_layout),
                (b, b_layout),
                c,
                parallel,
                epilogue,
            );
        }
        if (a_layout, b_layout) != (Layout::AsIs, Layout::AsIs) && m.min(n) < STRIDED_MIN_DIM {
            // faer computes thin products (a row, a column, a few of
            // either) with dot products whose summation order follows the
            // operands' strides, so a transposed view would give other bits
            // than the copy an eager `transpose` makes. Copying here keeps
            // every mode's results identical; at these sizes the copy is
            // no dearer than the product.
            let a = row_major(a, m, k, a_layout);
            let b = row_major(b, k, n, b_layout);
            return Self::gemm(
                (m, n, k),
                (&a, Layout::AsIs),
                (&b, Layout::AsIs),
                c,
                parallel,
                epilogue,
            );
        }
        // Forking onto the pool only pays off for large products, and a
        // product already running inside a parallel task stays serial.
        let threads = rayon::current_num_threads();
        // The epilogue may fork unless the caller is already a parallel
        // task: a large output of a small product (k of 1) still splits.
        let epilogue_may_split = parallel;
        let parallel = parallel && threads > 1 && m * n * k >= FAER_PARALLEL_FLOPS;
        let a = view(a, m, k, a_layout);
        let b = view(b, k, n, b_layout);
        if parallel && m >= threads * GEMM_MIN_PANEL_ROWS {
            // One serial product per thread on its own band of rows:
            // measured on 2 cores against faer's own parallel split,
            // 225 vs 185 GFLOP/s at 256³ and 316 vs 273 at 1024³,
            // and 16–26% faster on the MLP's shapes. Bands differ by at
            // most a row, so each has at least GEMM_MIN_PANEL_ROWS. Each
            // band's epilogue runs on its thread while the band is in its
            // cache, with no second fork.
            crate::pool::split_with_caller(row_bands(c, m, n, threads), |(row, height, c)| {
                let product = faer::MatMut::from_row_major_slice_mut(&mut *c, height, n);
                let a = a.subrows(row, height);
                let one = Self::one_value();
                let (accum, par) = (faer::Accum::Replace, faer::Par::Seq);
                faer::linalg::matmul::matmul(product, accum, a, b, one, par);
                epilogue(row * n, c, false);
            });
            return;
        }
        let par = if parallel {
            faer::Par::rayon(0)
        } else {
            faer::Par::Seq
        };
        let product = faer::MatMut::from_row_major_slice_mut(&mut c[..m * n], m, n);
        faer::linalg::matmul::matmul(product, faer::Accum::Replace, a, b, Self::one_value(), par);
        epilogue(0, &mut c[..m * n], epilogue_may_split);
    }

    /// 1 in this type (faer's `alpha` for a plain product).
    fn one_value() -> Self;

    /// Runs `f` on `len` values (of no particular value) that hold a
    /// halved product's second half (see [`halved`]). Types with an own
    /// kernel keep the buffer on the thread, so that a training step's
    /// products allocate nothing after the first; others never halve.
    fn with_second_half<R>(len: usize, f: impl FnOnce(&mut [Self]) -> R) -> R {
        f(&mut vec![Self::default(); len])
    }

    /// Stagecraft's own kernel for this type, where this machine runs one.
    fn own_gemm() -> Option<OwnGemm<Self>> {
        None
    }
}

impl GemmElement for f32 {
    fn one_value() -> f32 {
        1.0
    }

    #[cfg(target_arch = "x86_64")]
    fn own_gemm() -> Option<OwnGemm<f32>> {
        fn matrix(x: Strided<'_, f32>) -> super::sgemm::Matrix<'_> {
            super::sgemm::Matrix {
                values: x.values,
                row_stride: x.row_stride,
                col_stride: x.col_stride,
            }
        }
        fn run(
            mnk: (usize, usize, usize),
            a: Strided<'_, f32>,
            b: Strided<'_, f32>,
            c: &mut [f32],
        ) {
            let (m, n, k) = mnk;
            super::sgemm::sgemm(m, n, k, matrix(a), matrix(b), c)
        }
        super::sgemm::available().then_some(run as OwnGemm<f32>)
    }

    fn with_second_half<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
        thread_local! {
            static SECOND_HALF: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
        }
        // Taken, not borrowed: a product started on this thread while it
        // waits for its own halves gets a buffer of its own.
        let mut values = SECOND_HALF.take();
        values.resize(len, 0.0);
        let out = f(&mut values);
        SECOND_HALF.set(values);
        out
    }
}

impl GemmElement for f64 {
    fn one_value() -> f64 {
        1.0
    }
}

/// `c` (`m × n`, row-major) cut into `count` bands of rows that differ by
/// at most a row: `(first row, rows, values)` each.
fn row_bands<T>(c: &mut [T], m: usize, n: usize, count: usize) -> Vec<(usize, usize, &mut [T])> {
    let (base, extra) = (m / count, m % count);
    let mut bands = Vec::with_capacity(count);
    let (mut rest, mut row) = (&mut c[..m * n], 0);
    for band in 0..count {
        let height = base + usize::from(band < extra);
        let (head, tail) = rest.split_at_mut(height * n);
        bands.push((row, height, head));
        (rest, row) = (tail, row + height);
    }
    bands
}

/// [`GemmElement::gemm`] on an own kernel: one call on this thread, or
/// bands of rows over the pool, or for products with few rows and much
/// work, bands of columns (each into its own buffer, then copied); deep
/// products with small outputs are [`halved`].
///
/// The own kernels sum in an order that depends on `k` alone, and whether
/// a product is halved depends on its shape alone, so every split, stride,
/// batch and thread count gives the same bits and nothing is copied to keep
/// them equal.
fn own_gemm_split<T: GemmElement>(
    own: OwnGemm<T>,
    (m, n, k): (usize, usize, usize),
    (a, a_layout): (&[T], Layout),
    (b, b_layout): (&[T], Layout),
    c: &mut [T],
    parallel: bool,
    epilogue: Epilogue<'_, T>,
) {
    let c = &mut c[..m * n];
    let (a, b) = (
        Strided::new(a, m, k, a_layout),
        Strided::new(b, k, n, b_layout),
    );
    let threads = rayon::current_num_threads();
    let epilogue_may_split = parallel;
    let parallel = parallel && threads > 1 && worth_splitting(m, n, k);
    if is_halved(m, n, k) {
        let product = Product {
            own,
            mnk: (m, n, k),
            a,
            b,
        };
        let split = parallel.then_some(threads);
        return T::with_second_half(m * n, |second| {
            halved(product, c, second, split, epilogue, epilogue_may_split)
        });
    }
    if parallel && m >= threads * GEMM_MIN_PANEL_ROWS {
        // A band of rows per thread, as for faer (see there); each band's
        // epilogue runs on its thread while the band is in its cache.
        crate::pool::split_with_caller(row_bands(c, m, n, threads), |(row, height, c)| {
            own((height, n, k), a.from(row, 0), b, c);
            epilogue(row * n, c, false);
        });
        return;
    }
    if parallel && n >= threads * GEMM_MIN_PANEL_ROWS {
        // Few rows, many columns (a matrix times a vector): a band of
        // columns per thread, each into its own buffer, then copied.
        let width = n.div_ceil(threads);
        let mut parts: Vec<Vec<T>> = (0..n)
            .step_by(width)
            .map(|j| vec![T::default(); m * width.min(n - j)])
            .collect();
        let jobs = parts.iter_mut().enumerate().collect();
        crate::pool::split_with_caller(jobs, |(index, part): (usize, &mut Vec<T>)| {
            let j = index * width;
            own((m, width.min(n - j), k), a, b.from(0, j), part);
        });
        for (index, part) in parts.iter().enumerate() {
            let (j, cols) = (index * width, part.len() / m);
            for (row, values) in c.chunks_exact_mut(n).zip(part.chunks_exact(cols)) {
                row[j..j + cols].copy_from_slice(values);
            }
        }
        epilogue(0, c, epilogue_may_split);
        return;
    }
    own((m, n, k), a, b, c);
    epilogue(0, c, epilogue_may_split);
}

/// Whether an `m × k` by `k × n` product is summed as two halves of its
/// depth (see [`halved`]): a function of its shape alone, so that whether
/// it runs on one thread or several, alone or as an item of a batch, its
/// bits are the same.
fn is_halved(m: usize, n: usize, k: usize) -> bool {
    k >= HALVED_MIN_DEPTH && m.saturating_mul(n) <= HALVED_MAX_OUTPUT && worth_splitting(m, n, k)
}

/// An own kernel's product and its operands.
struct Product<'a, T> {
    own: OwnGemm<T>,
    mnk: (usize, usize, usize),
    a: Strided<'a, T>,
    b: Strided<'a, T>,
}

/// A deep product with a small output (the MLP's first layer: 128×784 by
/// 784×256) summed as two halves of its depth, one into `c` and one into
/// `second`, then added, and `epilogue` run over the sum. `split` is the
/// number of threads to use, `None` for this one alone.
///
/// Split into bands of rows, every thread reads all of the right operand;
/// in a training step that operand is a weight the previous step's update
/// just wrote, half of it on each core, so each thread waits for the half
/// in the other core's cache. A half of the depth per thread reads half of
/// each operand, and in a training step the half of the weight this
/// thread's core wrote (the update splits the weight by its rows, which are
/// the product's depth). Measured in the MLP step on 2 threads: the first
/// layer's product took 226 µs split into bands and 186 halved (the
/// product alone, with nothing rewritten, 167), the lazy step 0.90 →
/// 0.84 ms.
fn halved<T: GemmElement>(
    product: Product<'_, T>,
    c: &mut [T],
    second: &mut [T],
    split: Option<usize>,
    epilogue: Epilogue<'_, T>,
    epilogue_may_split: bool,
) {
    let Product { own, mnk, a, b } = product;
    let (m, n, k) = mnk;
    // A multiple of 16 deep, so each half's first column of a transposed
    // operand starts on a cache line when the operand does.
    let middle = k / 32 * 16;
    let run = |(depth_first, depth, row, height, out): (usize, usize, usize, usize, &mut [T])| {
        own(
            (height, n, depth),
            a.from(row, depth_first),
            b.from(depth_first, 0),
            out,
        );
    };
    let halves = [(0, middle, &mut *c), (middle, k - middle, &mut *second)];
    match split {
        Some(threads) => {
            // Each half in bands of rows when there are threads to spare.
            let bands = (threads / 2).clamp(1, (m / GEMM_MIN_PANEL_ROWS).max(1));
            let parts: Vec<_> = halves
                .into_iter()
                .flat_map(|(first, depth, out)| {
                    row_bands(out, m, n, bands)
                        .into_iter()
                        .map(move |(row, height, out)| (first, depth, row, height, out))
                })
                .collect();
            crate::pool::split_with_caller(parts, run);
        }
        None => {
            for (first, depth, out) in halves {
                run((first, depth, 0, m, out));
            }
        }
    }
    let second = &*second;
    let add = |row: usize, c: &mut [T]| {
        for (sum, &other) in c.iter_mut().zip(&second[row * n..]) {
            *sum += other;
        }
    };
    match split {
        Some(threads) if m * n >= HALVED_PARALLEL_ADD && m >= threads => {
            crate::pool::split_with_caller(row_bands(c, m, n, threads), |(row, _, c)| {
                add(row, c);
                epilogue(row * n, c, false);
            });
        }
        _ => {
            add(0, c);
            epilogue(0, c, epilogue_may_split);
        }
    }
}

/// A `rows × cols` matrix stored as some layout, made row-major: borrowed
/// when it already is, else copied into a pooled buffer (a fresh `Vec` of
/// this size costs more in page faults than the copy itself).
enum RowMajor<'a, T> {
    Borrowed(&'a [T]),
    Copied(Buffer),
}

impl<T: Element> std::ops::Deref for RowMajor<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            RowMajor::Borrowed(values) => values,
            RowMajor::Copied(buffer) => buffer
                .typed()
                .expect("`row_major` filled the buffer with whole `T` values"),
        }
    }
}

fn row_major<T: Element>(
    values: &[T],
    rows: usize,
    cols: usize,
    layout: Layout,
) -> RowMajor<'_, T> {
    match layout {
        Layout::AsIs => RowMajor::Borrowed(&values[..rows * cols]),
        Layout::Transposed => {
            let mut buffer = Buffer::for_overwrite(rows * cols * std::mem::size_of::<T>());
            let out = buffer
                .typed_mut::<T>()
                .expect("a fresh buffer is unique, and matmul's numeric types accept any bytes");
            // Element (r, c) sits at `c * rows + r`: output axis 0 has
            // source stride 1, the transpose kernel's tiled case.
            super::shape::transpose_tiled(values, out, &[rows, cols], &[1, rows], 0, 0);
            RowMajor::Copied(buffer)
        }
    }
}

/// Integer products: exact, wrapping, cache-friendly i-k-j loops.
fn int_gemm<T: Element + IntMulAdd>(m: usize, n: usize, k: usize, a: &[T], b: &[T], c: &mut [T]) {
    for i in 0..m {
        let row = &mut c[i * n..(i + 1) * n];
        row.fill(T::default());
        for p in 0..k {
            let av = a[i * k + p];
            for (cv, &bv) in row.iter_mut().zip(&b[p * n..(p + 1) * n]) {
                *cv = cv.mul_add_wrapping(av, bv);
            }
        }
    }
}

trait IntMulAdd: Copy {
    fn mul_add_wrapping(self, a: Self, b: Self) -> Self;
}

macro_rules! int_mul_add {
    ($($t:ty),*) => {$(
        impl IntMulAdd for $t {
            fn mul_add_wrapping(self, a: $t, b: $t) -> $t {
                self.wrapping_add(a.wrapping_mul(b))
            }
        }
    )*};
}
int_mul_add!(u8, i8, u16, i16, u32, i32, u64, i64);

/// The geometry of a batched product, resolved once per call.
struct Plan {
    m: usize,
    k: usize,
    n: usize,
    a_layout: Layout,
    b_layout: Layout,
    batch: Shape,
    a_batch_strides: smallvec::SmallVec<[usize; 4]>,
    b_batch_strides: smallvec::SmallVec<[usize; 4]>,
}

impl Plan {
    fn new(a: &Shape, b: &Shape, (ta, tb): (bool, bool)) -> Result<Plan> {
        let (batch, m, k, n, _) =
            matmul_shapes(&matmul_operand(a, ta, "a")?, &matmul_operand(b, tb, "b")?)?;
        let a_batch = Shape::new(&a.dims()[..a.rank().saturating_sub(2)]);
        let b_batch = Shape::new(&b.dims()[..b.rank().saturating_sub(2)]);
        Ok(Plan {
            m,
            k,
            n,
            a_layout: Layout::of(ta),
            b_layout: Layout::of(tb),
            a_batch_strides: broadcast_strides(&a_batch, &batch),
            b_batch_strides: broadcast_strides(&b_batch, &batch),
            batch,
        })
    }

    /// Element offsets of the `a` and `b` matrices of batch item `index`.
    fn offsets(&self, index: usize) -> (usize, usize) {
        let (mut rest, mut oa, mut ob) = (index, 0, 0);
        for axis in (0..self.batch.rank()).rev() {
            let dim = self.batch[axis];
            let i = rest % dim;
            rest /= dim;
            oa += i * self.a_batch_strides[axis];
            ob += i * self.b_batch_strides[axis];
        }
        (oa * self.m * self.k, ob * self.k * self.n)
    }
}

fn batched<T: Element + Send + Sync>(
    a: &[T],
    b: &[T],
    out: &mut [T],
    plan: &Plan,
    single: impl Fn(usize, &[T], &[T], &mut [T], bool) + Sync,
) {
    let (m, n) = (plan.m, plan.n);
    let items = plan.batch.numel();
    // Items first: with none, `m * n` may overflow (an empty batch lets
    // the matrix dimensions be anything).
    if items == 0 || m == 0 || n == 0 {
        return;
    }
    let work = (m * n).saturating_mul(plan.k);
    let run = |(index, c): (usize, &mut [T]), parallel: bool| {
        let (oa, ob) = plan.offsets(index);
        single(
            index * m * n,
            &a[oa..oa + m * plan.k],
            &b[ob..ob + plan.k * n],
            c,
            parallel,
        );
    };
    if items > 1 && work * items >= BATCH_SPLIT_FLOPS && work < BATCH_SPLIT_FLOPS * 8 {
        // Many modest products: one per task.
        crate::pool::for_each_chunk(out, m * n, |i, c| run((i, c), false));
    } else {
        out.chunks_mut(m * n)
            .enumerate()
            .for_each(|item| run(item, true));
    }
}

/// `x · y` (each transposed as `transposes` says) into a new tensor.
pub(crate) fn matmul_typed<T: GemmElement + Send + Sync>(
    x: &DenseHostTensor,
    y: &DenseHostTensor,
    meta: &TensorMetadata,
    transposes: (bool, bool),
) -> Result<DenseHostTensor> {
    matmul_with_epilogue::<T>(x, y, meta, transposes, &no_epilogue)
}

/// [`matmul_typed`], with `epilogue` run over each finished part of the
/// product (see [`Epilogue`]).
pub(crate) fn matmul_with_epilogue<T: GemmElement + Send + Sync>(
    x: &DenseHostTensor,
    y: &DenseHostTensor,
    meta: &TensorMetadata,
    transposes: (bool, bool),
    epilogue: Epilogue<'_, T>,
) -> Result<DenseHostTensor> {
    let plan = Plan::new(x.shape(), y.shape(), transposes)?;
    // `Accum::Replace` writes every element of a product with k > 0.
    let mut out = if plan.k > 0 {
        DenseHostTensor::for_overwrite(meta.clone())?
    } else {
        DenseHostTensor::zeros(meta.clone())?
    };
    let (m, k, n) = (plan.m, plan.k, plan.n);
    let (la, lb) = (plan.a_layout, plan.b_layout);
    batched(
        x.as_slice::<T>()?,
        y.as_slice::<T>()?,
        out.as_mut_slice::<T>()?,
        &plan,
        |first, a, b, c, par| {
            let item = |offset: usize, values: &mut [T], may_split: bool| {
                epilogue(first + offset, values, may_split)
            };
            T::gemm((m, n, k), (a, la), (b, lb), c, par, &item)
        },
    );
    Ok(out)
}

/// f16 and bf16 products accumulate in f32, then round once.
fn matmul_half<T: Element>(
    x: &DenseHostTensor,
    y: &DenseHostTensor,
    meta: &TensorMetadata,
    transposes: (bool, bool),
    widen: fn(T) -> f32,
    narrow: fn(f32) -> T,
) -> Result<DenseHostTensor> {
    let wide = |t: &DenseHostTensor| -> Result<DenseHostTensor> {
        let values: Vec<f32> = t.as_slice::<T>()?.iter().map(|&v| widen(v)).collect();
        DenseHostTensor::from_slice(&values, t.shape().clone())
    };
    let product = matmul_typed::<f32>(
        &wide(x)?,
        &wide(y)?,
        &TensorMetadata::new(DType::F32, meta.shape.clone()),
        transposes,
    )?;
    let values: Vec<T> = product
        .as_slice::<f32>()?
        .iter()
        .map(|&v| narrow(v))
        .collect();
    DenseHostTensor::from_slice(&values, meta.shape.clone())
}

fn matmul_int<T: Element + IntMulAdd>(
    x: &DenseHostTensor,
    y: &DenseHostTensor,
    meta: &TensorMetadata,
    transposes: (bool, bool),
) -> Result<DenseHostTensor> {
    let plan = Plan::new(x.shape(), y.shape(), transposes)?;
    let mut out = DenseHostTensor::zeros(meta.clone())?;
    let (m, k, n) = (plan.m, plan.k, plan.n);
    let (la, lb) = (plan.a_layout, plan.b_layout);
    batched(
        x.as_slice::<T>()?,
        y.as_slice::<T>()?,
        out.as_mut_slice::<T>()?,
        &plan,
        |_, a, b, c, _| {
            let (a, b) = (row_major(a, m, k, la), row_major(b, k, n, lb));
            int_gemm(m, n, k, &a, &b, c)
        },
    );
    Ok(out)
}

type MatMulFn = fn(
    &DenseHostTensor,
    &DenseHostTensor,
    &TensorMetadata,
    (bool, bool),
) -> Result<DenseHostTensor>;

fn matmul_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let transposes = matmul_transposes(attrs)?;
    let run: MatMulFn = match inputs[0].dtype {
        DType::F32 => matmul_typed::<f32>,
        DType::F64 => matmul_typed::<f64>,
        DType::F16 => |x, y, m, t| matmul_half::<f16>(x, y, m, t, f16::to_f32, f16::from_f32),
        DType::BF16 => |x, y, m, t| matmul_half::<bf16>(x, y, m, t, bf16::to_f32, bf16::from_f32),
        DType::U8 => matmul_int::<u8>,
        DType::I8 => matmul_int::<i8>,
        DType::U16 => matmul_int::<u16>,
        DType::I16 => matmul_int::<i16>,
        DType::U32 => matmul_int::<u32>,
        DType::U64 => matmul_int::<u64>,
        DType::I32 => matmul_int::<i32>,
        DType::I64 => matmul_int::<i64>,
        DType::Bool => return Err(Error::dtype("matmul is not defined for bool")),
        DType::List => return Err(crate::numeric::list_operand()),
    };
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            Ok(smallvec![run(
                &inputs[0],
                &inputs[1],
                &ctx.outputs[0],
                transposes
            )?])
        },
    ))
}

/// `c = a · b` for contiguous row-major f32/f64 matrices, used by other
/// kernel families (convolution).
pub(crate) fn gemm_into<T: GemmElement>(
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    b: &[T],
    c: &mut [T],
    parallel: bool,
) {
    let (a, b) = ((a, Layout::AsIs), (b, Layout::AsIs));
    T::gemm((m, n, k), a, b, c, parallel, &no_epilogue)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::linalg::matmul as reference;
    use proptest::prelude::*;
    use stagecraft_ops::OpAttrs;

    fn run(a: &DenseHostTensor, b: &DenseHostTensor) -> DenseHostTensor {
        run_flagged(a, b, (false, false))
    }

    fn run_flagged(
        a: &DenseHostTensor,
        b: &DenseHostTensor,
        (ta, tb): (bool, bool),
    ) -> DenseHostTensor {
        let def = &stagecraft_ops::MATMUL;
        let mut attrs = OpAttrs::new();
        attrs.set_bool("transpose_a", ta);
        attrs.set_bool("transpose_b", tb);
        let metas = [a.metadata().clone(), b.metadata().clone()];
        let out = def.infer(&metas, &attrs).unwrap();
        let k = (crate::registry().get(def).unwrap())(&Attrs::new(&attrs, def), &metas).unwrap();
        let mut res = k(
            smallvec![a.clone(), b.clone()],
            &KernelContext {
                attrs: Attrs::new(&attrs, def),
                outputs: &out,
            },
        )
        .unwrap();
        res.remove(0)
    }

    /// `t` with its last two dimensions swapped, copied.
    fn swapped<T: Element>(t: &DenseHostTensor) -> DenseHostTensor {
        let dims = t.shape().dims();
        let (rank, v) = (dims.len(), t.as_slice::<T>().unwrap());
        let (rows, cols) = (dims[rank - 2], dims[rank - 1]);
        let mut out = Vec::with_capacity(v.len());
        for matrix in v.chunks(rows * cols) {
            for c in 0..cols {
                out.extend((0..rows).map(|r| matrix[r * cols + c]));
            }
        }
        let mut new_dims = dims.to_vec();
        new_dims.swap(rank - 2, rank - 1);
        DenseHostTensor::from_slice(&out, new_dims.as_slice()).unwrap()
    }

    fn bits(t: &DenseHostTensor) -> Vec<u8> {
        t.buffer().bytes().to_vec()
    }

    /// A transposed operand read through strides gives the bits of the same
    /// product on a transposed copy (what eager `transpose` + `matmul`
    /// computes), for thin products (copied first) and wide ones (strided),
    /// serial and banded over threads, batched and broadcast, every dtype.
    #[test]
    fn transposed_operands_give_the_bits_of_transposed_copies() {
        fn case<T: Element>(a_dims: &[usize], b_dims: &[usize], cast: fn(f64) -> T) {
            let a: Vec<T> = values(a_dims, 3).into_iter().map(cast).collect();
            let b: Vec<T> = values(b_dims, 4).into_iter().map(cast).collect();
            let a = DenseHostTensor::from_slice(&a, a_dims).unwrap();
            let b = DenseHostTensor::from_slice(&b, b_dims).unwrap();
            let want = bits(&run(&a, &b));
            let (at, bt) = (swapped::<T>(&a), swapped::<T>(&b));
            for (flags, x, y) in [((true, false), &at, &b), ((false, true), &a, &bt)] {
                let got = run_flagged(x, y, flags);
                assert_eq!(got.shape().dims(), run(&a, &b).shape().dims());
                assert!(bits(&got) == want, "{a_dims:?}@{b_dims:?} {flags:?}");
            }
            assert!(bits(&run_flagged(&at, &bt, (true, true))) == want);
        }
        let shapes: &[(&[usize], &[usize])] = &[
            (&[2, 130], &[130, 2]),
            (&[1, 64], &[64, 64]),
            (&[64, 64], &[64, 1]),
            (&[5, 7], &[7, 6]),
            (&[16, 3], &[3, 16]),
            (&[33, 130], &[130, 17]),
            (&[128, 784], &[784, 256]),
            (&[256, 128], &[128, 256]),
            (&[4, 600], &[600, 900]),
            (&[3, 40, 20], &[20, 24]),
            (&[2, 1, 18, 5], &[3, 5, 19]),
        ];
        for (a, b) in shapes {
            case::<f32>(a, b, |v| v as f32);
            case::<f64>(a, b, |v| v);
            case::<i64>(a, b, |v| (v * 4.0) as i64);
            case::<half::f16>(a, b, half::f16::from_f64);
        }
    }

    /// Deep products with small outputs are summed as two halves of their
    /// depth: the same bits on one thread, on two (a half each) and on
    /// four (each half in bands of rows), plain or transposed, close to
    /// the f64 product, with the epilogue run once over the sum, at the
    /// right offsets.
    #[test]
    fn halved_products_keep_their_bits_on_every_thread_count() {
        let shapes = [
            (128, 784, 256),
            (1, 2100, 1000),
            (40, 800, 70),
            (33, 1500, 64),
        ];
        for (m, k, n) in shapes {
            assert!(is_halved(m, n, k), "{m}×{k}×{n}");
            let (av, bv) = (values(&[m, k], 5), values(&[k, n], 6));
            let a: Vec<f32> = av.iter().map(|&v| v as f32).collect();
            let b: Vec<f32> = bv.iter().map(|&v| v as f32).collect();
            let bt: Vec<f32> = (0..k * n).map(|i| b[(i % k) * n + i / k]).collect();
            let index = |first: usize, values: &mut [f32], _: bool| {
                for (i, v) in values.iter_mut().enumerate() {
                    *v += (first + i) as f32;
                }
            };
            let product = |threads: usize, parallel: bool, transposed: bool| {
                let mut c = vec![f32::NAN; m * n];
                let b = if transposed {
                    (&bt[..], Layout::Transposed)
                } else {
                    (&b[..], Layout::AsIs)
                };
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    f32::gemm((m, n, k), (&a, Layout::AsIs), b, &mut c, parallel, &index)
                });
                c
            };
            let want = product(1, false, false);
            let (reference, _) = reference(&av, &[m, k], &bv, &[k, n]);
            for (i, (g, w)) in want.iter().zip(&reference).enumerate() {
                let w = w + i as f64;
                let tolerance = 1e-5 * k as f64 * (1.0 + w.abs());
                assert!(
                    (*g as f64 - w).abs() <= tolerance,
                    "{m}×{k}×{n}: {g} vs {w}"
                );
            }
            for (threads, transposed) in [(2, false), (2, true), (4, false), (3, true)] {
                let got = product(threads, true, transposed);
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits());
                assert!(
                    same,
                    "{m}×{k}×{n} on {threads} threads, transposed {transposed}"
                );
            }
        }
    }

    #[test]
    fn transposing_a_vector_is_an_attribute_error() {
        let mut attrs = OpAttrs::new();
        attrs.set_bool("transpose_b", true);
        let f = |d: &[usize]| TensorMetadata::new(DType::F32, d);
        let err = stagecraft_ops::MATMUL
            .infer(&[f(&[2, 3]), f(&[3])], &attrs)
            .unwrap_err();
        assert!(err.to_string().contains("transpose_b"), "{err}");
        let out = stagecraft_ops::MATMUL
            .infer(&[f(&[2, 3]), f(&[4, 3])], &attrs)
            .unwrap();
        assert_eq!(out[0].shape.dims(), &[2, 4]);
    }

    fn values(dims: &[usize], seed: usize) -> Vec<f64> {
        let n: usize = dims.iter().product();
        (0..n)
            .map(|i| (((i * 7919 + seed * 104729) % 1000) as f64 - 500.0) / 250.0)
            .collect()
    }

    fn check(a_dims: &[usize], b_dims: &[usize]) {
        let (av, bv) = (values(a_dims, 1), values(b_dims, 2));
        let (want, want_dims) = reference(&av, a_dims, &bv, b_dims);
        let a32: Vec<f32> = av.iter().map(|&v| v as f32).collect();
        let b32: Vec<f32> = bv.iter().map(|&v| v as f32).collect();
        let got = run(
            &DenseHostTensor::from_slice(&a32, a_dims).unwrap(),
            &DenseHostTensor::from_slice(&b32, b_dims).unwrap(),
        );
        assert_eq!(got.shape().dims(), want_dims.as_slice());
        let k = if a_dims.is_empty() {
            1
        } else {
            a_dims[a_dims.len() - 1]
        };
        for (g, w) in got.as_slice::<f32>().unwrap().iter().zip(&want) {
            assert!(
                (*g as f64 - w).abs() <= 1e-5 * (k as f64) * (1.0 + w.abs()),
                "{a_dims:?}@{b_dims:?}: {g} vs {w}"
            );
        }
        let got64 = run(
            &DenseHostTensor::from_slice(&av, a_dims).unwrap(),
            &DenseHostTensor::from_slice(&bv, b_dims).unwrap(),
        );
        for (g, w) in got64.as_slice::<f64>().unwrap().iter().zip(&want) {
            assert!((g - w).abs() <= 1e-12 * (k as f64) * (1.0 + w.abs()));
        }
        let ai: Vec<i64> = av.iter().map(|&v| (v * 4.0) as i64).collect();
        let bi: Vec<i64> = bv.iter().map(|&v| (v * 4.0) as i64).collect();
        let (wi, _) = reference(
            &ai.iter().map(|&v| v as f64).collect::<Vec<_>>(),
            a_dims,
            &bi.iter().map(|&v| v as f64).collect::<Vec<_>>(),
            b_dims,
        );
        let gi = run(
            &DenseHostTensor::from_slice(&ai, a_dims).unwrap(),
            &DenseHostTensor::from_slice(&bi, b_dims).unwrap(),
        );
        assert_eq!(
            gi.as_slice::<i64>().unwrap(),
            wi.iter().map(|&v| v as i64).collect::<Vec<_>>().as_slice()
        );
    }

    #[test]
    fn matches_reference_on_many_shapes() {
        for (a, b) in [
            (vec![2, 3], vec![3, 4]),
            (vec![1, 1], vec![1, 1]),
            (vec![3], vec![3, 5]),
            (vec![4, 3], vec![3]),
            (vec![7], vec![7]),
            (vec![5, 2, 3], vec![3, 4]),
            (vec![2, 1, 3, 4], vec![5, 4, 2]),
            (vec![0, 3], vec![3, 4]),
            (vec![2, 0], vec![0, 3]),
            (vec![3, 0, 2, 3], vec![3, 2]),
            (vec![130, 70], vec![70, 150]),
            (vec![4, 64, 64], vec![4, 64, 64]),
        ] {
            check(&a, &b);
        }
    }

    #[test]
    fn large_parallel_product_matches() {
        check(&[200, 300], &[300, 100]);
        // Uneven row bands.
        check(&[201, 300], &[300, 97]);
        // Too few rows for bands of rows: bands of columns.
        check(&[4, 600], &[600, 900]);
    }

    #[test]
    fn half_precision_accumulates_in_f32() {
        let a: Vec<f16> = (0..64).map(|i| f16::from_f32(i as f32 / 64.0)).collect();
        let b: Vec<f16> = vec![f16::ONE; 64];
        let got = run(
            &DenseHostTensor::from_slice(&a, [1, 64]).unwrap(),
            &DenseHostTensor::from_slice(&b, [64, 1]).unwrap(),
        );
        assert_eq!(got.as_slice::<f16>().unwrap()[0], f16::from_f32(31.5));
        let a: Vec<bf16> = vec![bf16::from_f32(0.5); 6];
        let got = run(
            &DenseHostTensor::from_slice(&a, [2, 3]).unwrap(),
            &DenseHostTensor::from_slice(&a, [3, 2]).unwrap(),
        );
        assert_eq!(got.as_slice::<bf16>().unwrap(), &[bf16::from_f32(0.75); 4]);
    }

    #[test]
    fn nan_propagates() {
        let got = run(
            &DenseHostTensor::from_slice(&[f32::NAN, 1.0], [1, 2]).unwrap(),
            &DenseHostTensor::from_slice(&[1.0f32, 1.0], [2, 1]).unwrap(),
        );
        assert!(got.as_slice::<f32>().unwrap()[0].is_nan());
    }

    proptest! {
        #[test]
        fn batched_broadcasting_matches_reference(
            batch_a in proptest::collection::vec(1usize..3, 0..3),
            batch_b in proptest::collection::vec(1usize..3, 0..3),
            m in 0usize..6, k in 0usize..6, n in 0usize..6,
        ) {
            // Make the batch dims broadcast-compatible: where both exist and
            // differ, use 1 on one side.
            let rank = batch_a.len().max(batch_b.len());
            let mut a_dims = batch_a.clone();
            let mut b_dims = batch_b.clone();
            for i in 0..rank {
                let ia = (i + a_dims.len()).checked_sub(rank);
                let ib = (i + b_dims.len()).checked_sub(rank);
                if let (Some(ia), Some(ib)) = (ia, ib) {
                    if a_dims[ia] != b_dims[ib] { b_dims[ib] = 1; }
                }
            }
            a_dims.extend([m, k]);
            b_dims.extend([k, n]);
            check(&a_dims, &b_dims);
        }
    }
}
