#[path = "../../../../crates/stagecraft-cpu/src/kernels/sgemm.rs"]
#[allow(dead_code)]
mod sgemm;
use std::time::Instant;
fn main() {
    let all: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<usize> = all.iter().take(3).map(|a| a.parse().unwrap()).collect();
    let (m, n, k) = (args[0], args[1], args[2]);
    // Optional layouts: "nn" (default), "nt" (B stored transposed), "tn".
    let layout = all.get(3).cloned().unwrap_or_else(|| "nn".into());
    let (a_t, b_t) = (layout.as_bytes()[0] == b't', layout.as_bytes()[1] == b't');
    let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 13) as f32 * 0.01).collect();
    let mut c = vec![0f32; m * n];
    let am = if a_t { sgemm::Matrix { values: &a, row_stride: 1, col_stride: m } } else { sgemm::Matrix { values: &a, row_stride: k, col_stride: 1 } };
    let bm = if b_t { sgemm::Matrix { values: &b, row_stride: 1, col_stride: k } } else { sgemm::Matrix { values: &b, row_stride: n, col_stride: 1 } };
    let reps = (3e9 / (2.0 * (m * n * k) as f64)).max(3.0) as usize;
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        let t = Instant::now();
        for _ in 0..reps { sgemm::sgemm(m, n, k, am, bm, &mut c); }
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    println!("{m}x{n}x{k} {layout}: {:.1} GFLOP/s, {:.2} us", 2.0 * (m * n * k) as f64 / best / 1e9, best * 1e6);
}
#[path = "../isa_shim.rs"]
mod isa;
