//! How to spread one f32 GEMM of the MLP's shapes over two threads:
//! measures each strategy on each shape, best of many runs, in GFLOP/s.
//! Run: `cargo run --release` (2 threads) and
//! `RAYON_NUM_THREADS=1 taskset -c 0 cargo run --release`.

use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;
use std::time::Instant;

#[path = "../../../crates/stagecraft-cpu/src/kernels/sgemm.rs"]
#[allow(dead_code)]
mod sgemm;

fn matrix(values: &[f32], cols: usize, transposed_rows: usize, transposed: bool) -> sgemm::Matrix<'_> {
    if transposed {
        sgemm::Matrix { values, row_stride: 1, col_stride: transposed_rows }
    } else {
        sgemm::Matrix { values, row_stride: cols, col_stride: 1 }
    }
}

/// stagecraft's own kernel, a band of rows per thread.
fn own_rows(c: &mut [f32], a: sgemm::Matrix<'_>, b: sgemm::Matrix<'_>, m: usize, n: usize, k: usize) {
    let threads = rayon::current_num_threads();
    if threads == 1 {
        return sgemm::sgemm(m, n, k, a, b, c);
    }
    let h = m.div_ceil(threads);
    c.par_chunks_mut(h * n).enumerate().for_each(|(i, band)| {
        let rows = band.len() / n;
        let a = sgemm::Matrix { values: &a.values[i * h * a.row_stride..], ..a };
        sgemm::sgemm(rows, n, k, a, b, band);
    });
}

#[derive(Clone, Copy)]
struct Case {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    /// `a` is stored as its transpose (`[k, m]`).
    ta: bool,
    /// `b` is stored as its transpose (`[n, k]`).
    tb: bool,
}

const CASES: &[Case] = &[
    Case { name: "fwd1 x·W1", m: 128, n: 256, k: 784, ta: false, tb: false },
    Case { name: "fwd2 h·W2", m: 128, n: 256, k: 256, ta: false, tb: false },
    Case { name: "bwd dW1=xT·g", m: 784, n: 256, k: 128, ta: true, tb: false },
    Case { name: "bwd dW2=hT·g", m: 256, n: 256, k: 128, ta: true, tb: false },
    Case { name: "bwd dh1=g·W2T", m: 128, n: 256, k: 256, ta: false, tb: true },
    Case { name: "sq 256", m: 256, n: 256, k: 256, ta: false, tb: false },
    Case { name: "sq 1024", m: 1024, n: 1024, k: 1024, ta: false, tb: false },
];

/// The GPT step's products (B7: batch 12 × 64 positions, width 128):
/// forward x·Wᵀ, backward dX = dY·W and dW = dYᵀ·X.
const GPT_CASES: &[Case] = &[
    Case { name: "qkv x·Wt", m: 768, n: 384, k: 128, ta: false, tb: true },
    Case { name: "proj x·Wt", m: 768, n: 128, k: 128, ta: false, tb: true },
    Case { name: "fc x·Wt", m: 768, n: 512, k: 128, ta: false, tb: true },
    Case { name: "fc2 x·Wt", m: 768, n: 128, k: 512, ta: false, tb: true },
    Case { name: "qkv dX", m: 768, n: 128, k: 384, ta: false, tb: false },
    Case { name: "fc dX", m: 768, n: 128, k: 512, ta: false, tb: false },
    Case { name: "fc2 dX", m: 768, n: 512, k: 128, ta: false, tb: false },
    Case { name: "qkv dW", m: 384, n: 128, k: 768, ta: true, tb: false },
    Case { name: "fc dW", m: 512, n: 128, k: 768, ta: true, tb: false },
    Case { name: "fc2 dW", m: 128, n: 512, k: 768, ta: true, tb: false },
    Case { name: "proj dW", m: 128, n: 128, k: 768, ta: true, tb: false },
];

fn view(values: &[f32], rows: usize, cols: usize, transposed: bool) -> MatRef<'_, f32> {
    if transposed {
        MatRef::from_row_major_slice(values, cols, rows).transpose()
    } else {
        MatRef::from_row_major_slice(values, rows, cols)
    }
}

fn serial(c: MatMut<'_, f32>, a: MatRef<'_, f32>, b: MatRef<'_, f32>) {
    faer::linalg::matmul::matmul(c, Accum::Replace, a, b, 1.0, Par::Seq);
}

/// What stagecraft does now: a band of rows per thread.
fn row_bands(c: &mut [f32], a: MatRef<'_, f32>, b: MatRef<'_, f32>, m: usize, n: usize) {
    let threads = rayon::current_num_threads();
    if threads == 1 {
        return serial(MatMut::from_row_major_slice_mut(c, m, n), a, b);
    }
    let h = m.div_ceil(threads);
    c.par_chunks_mut(h * n).enumerate().for_each(|(i, band)| {
        let rows = band.len() / n;
        serial(MatMut::from_row_major_slice_mut(band, rows, n), a.subrows(i * h, rows), b);
    });
}

/// A band of columns per thread: each packs half of `b` instead of all.
fn col_bands(c: &mut [f32], a: MatRef<'_, f32>, b: MatRef<'_, f32>, m: usize, n: usize) {
    let threads = rayon::current_num_threads();
    let c = MatMut::from_row_major_slice_mut(c, m, n);
    if threads == 1 {
        return serial(c, a, b);
    }
    let w = n.div_ceil(2);
    let (left, right) = c.split_at_col_mut(w);
    rayon::join(
        || serial(left, a, b.subcols(0, w)),
        || serial(right, a, b.subcols(w, n - w)),
    );
}

/// faer's own parallel split.
fn faer_par(c: &mut [f32], a: MatRef<'_, f32>, b: MatRef<'_, f32>, m: usize, n: usize) {
    let par = Par::rayon(rayon::current_num_threads());
    let c = MatMut::from_row_major_slice_mut(c, m, n);
    faer::linalg::matmul::matmul(c, Accum::Replace, a, b, 1.0, par);
}

/// The `gemm` crate, row-major strides given directly.
fn gemm_crate(c: &mut [f32], case: &Case, a: &[f32], b: &[f32]) {
    let Case { m, n, k, ta, tb, .. } = *case;
    // (column stride, row stride) of each operand in elements.
    let (a_cs, a_rs) = if ta { (m as isize, 1) } else { (1, k as isize) };
    let (b_cs, b_rs) = if tb { (k as isize, 1) } else { (1, n as isize) };
    let threads = rayon::current_num_threads();
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the slices hold m·k, k·n and m·n elements, addressed through
    // the strides above within those bounds; `c` is not aliased.
    unsafe {
        gemm::gemm(
            m, n, k,
            c.as_mut_ptr(), 1, n as isize,
            false,
            a.as_ptr(), a_cs, a_rs,
            b.as_ptr(), b_cs, b_rs,
            0.0f32, 1.0f32,
            false, false, false,
            par,
        );
    }
}

fn best_of(mut f: impl FnMut(), flops: f64) -> f64 {
    // Warm up, then take the best of batches of runs (noise only slows).
    for _ in 0..20 {
        f();
    }
    let reps = ((2e9 / flops) as usize).clamp(3, 2000);
    let mut best = f64::INFINITY;
    for _ in 0..15 {
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    flops / best / 1e9
}

fn main() {
    let all = std::env::var_os("ALL").is_some();
    println!("threads: {}", rayon::current_num_threads());
    println!("{:<16} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}", "shape", "serial", "rows", "own", "own-rows", "cols", "faer-par", "gemm");
    let cases = if std::env::var_os("GPT").is_some() { GPT_CASES } else { CASES };
    for case in cases {
        let (m, n, k) = (case.m, case.n, case.k);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01 - 0.07).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 13) as f32 * 0.01 - 0.05).collect();
        let mut c = vec![0f32; m * n];
        let av = view(&a, m, k, case.ta);
        let bv = view(&b, k, n, case.tb);
        let (ao, bo) = (matrix(&a, k, m, case.ta), matrix(&b, n, k, case.tb));
        serial(MatMut::from_row_major_slice_mut(&mut c, m, n), av, bv);
        let want = c.clone();
        own_rows(&mut c, ao, bo, m, n, k);
        let err = want.iter().zip(&c).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(err < 1e-3, "{}: max diff {err}", case.name);
        let flops = 2.0 * (m * n * k) as f64;
        let s = best_of(|| serial(MatMut::from_row_major_slice_mut(&mut c, m, n), av, bv), flops);
        let r = best_of(|| row_bands(&mut c, av, bv, m, n), flops);
        let o = best_of(|| sgemm::sgemm(m, n, k, ao, bo, &mut c), flops);
        let orow = best_of(|| own_rows(&mut c, ao, bo, m, n, k), flops);
        let (mut cb, mut fp, mut g) = (0.0, 0.0, 0.0);
        if all {
            cb = best_of(|| col_bands(&mut c, av, bv, m, n), flops);
            fp = best_of(|| faer_par(&mut c, av, bv, m, n), flops);
            g = best_of(|| gemm_crate(&mut c, case, &a, &b), flops);
        }
        println!("{:<16} {s:>9.1} {r:>9.1} {o:>9.1} {orow:>9.1} {cb:>9.1} {fp:>9.1} {g:>9.1}", case.name);
    }
}
#[path = "isa_shim.rs"]
mod isa;
