//! B3, B4 and B5 on `gpu:0` (wgpu), eager and lazy, for the side-by-side
//! run with PyTorch CUDA (`scripts/bench_torch_cuda.py`) on a machine with
//! a GPU. On Mesa's software driver these rows measure the CPU running
//! shaders, not a GPU: the header names the adapter, and only a hardware
//! adapter's figures are speed.
//!
//! - the fixed costs: waiting for an idle GPU, and a 4-element add;
//! - B3: the 8-op chain over 16M f32, lazy (one fused shader) and eager
//!   (eight kernels), beside one elementwise kernel over the same bytes
//!   (`x·2`: one read, one write), the floor the fused chain can reach;
//! - B4: f32 matrix products at 256³ and 1024³ (GFLOP/s = 2n³ / time);
//! - B5: the MLP 784-256-256-10 training step (batch 128, softmax
//!   cross-entropy, gradients by `backward`, plain SGD), the loss read on
//!   the host each step.
//!
//! Every timed iteration ends with the GPU's work finished
//! (`Device::synchronize`, or the loss read back), as the peer calls
//! `torch.cuda.synchronize`: a GPU value is ready when its kernels are
//! recorded, before they run.
//!
//! `cargo bench -p stagecraft --features wgpu --bench gpu`

mod common;
use common::{b3, mlp_batch, Mlp};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use stagecraft::{lazy, Device, Rng, Tensor};
use std::time::Duration;

fn gpu() -> Device {
    Device::try_gpu(0).unwrap_or_else(|e| panic!("the GPU bench needs gpu:0: {e}"))
}

/// Waits for `t`'s kernels to finish.
fn done(t: &Tensor<f32>) {
    t.wait().unwrap();
    t.device().synchronize().unwrap();
}

fn header() {
    let gpu = gpu();
    let adapter = stagecraft::layers::wgpu::Gpu::get(0)
        .map(|g| g.adapter_name().to_string())
        .unwrap_or_default();
    println!(
        "gpu bench on {} ({adapter}); host {}",
        gpu.name(),
        common::host()
    );
}

/// The fixed costs under every row: waiting for an idle GPU, and one
/// tiny kernel launched and waited for.
fn overheads(c: &mut Criterion) {
    let gpu = gpu();
    let mut group = c.benchmark_group("gpu_overheads");
    group.bench_function("synchronize_idle", |bench| {
        bench.iter(|| gpu.synchronize().unwrap())
    });
    let x = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[4], &gpu).unwrap();
    group.bench_function("add_4_elements", |bench| bench.iter(|| done(&(&x + &x))));
    group.finish();
}

fn b3_chain(c: &mut Criterion) {
    const N: usize = 16 << 20;
    let mut group = c.benchmark_group("gpu_B3_chain_16M");
    group.throughput(Throughput::Bytes((2 * N * 4) as u64));
    for (name, d) in [("lazy", Device::lazy(&gpu())), ("eager", gpu())] {
        let x = Tensor::<f32>::full(&[N], 0.5, &d);
        lazy::mark_step();
        x.wait().unwrap();
        group.bench_function(name, |bench| {
            bench.iter(|| {
                let y = b3(&x);
                lazy::mark_step();
                done(&y)
            })
        });
    }
    let x = Tensor::<f32>::full(&[N], 0.5, &gpu());
    x.wait().unwrap();
    group.bench_function("baseline_one_elementwise_kernel", |bench| {
        bench.iter(|| done(&(&x * 2.0)))
    });
    group.finish();
}

fn matmul(c: &mut Criterion) {
    let gpu = gpu();
    let mut rng = Rng::new(1);
    let mut group = c.benchmark_group("gpu_B4_matmul_f32");
    for n in [256usize, 1024] {
        let a = Tensor::<f32>::rand_uniform(&[n, n], -1.0, 1.0, &mut rng, &gpu);
        let b = Tensor::<f32>::rand_uniform(&[n, n], -1.0, 1.0, &mut rng, &gpu);
        a.wait().unwrap();
        b.wait().unwrap();
        group.throughput(Throughput::Elements((2 * n * n * n) as u64));
        group.bench_with_input(BenchmarkId::new("eager", n), &n, |bench, _| {
            bench.iter(|| done(&a.matmul(&b)))
        });
    }
    group.finish();
}

fn mlp_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("gpu_B5_mlp_784_256_256_10_b128");
    for (name, d) in [("lazy", Device::lazy(&gpu())), ("eager", gpu())] {
        let mut model = Mlp::new(&d);
        let (x, y) = mlp_batch(&d);
        lazy::mark_step();
        // One SGD step; the loss read on the host.
        let mut step = || {
            let loss = model.autodiff_step(&x, &y, 0.01);
            lazy::mark_step();
            loss.item().unwrap()
        };
        for _ in 0..5 {
            step();
        }
        group.bench_function(name, |bench| bench.iter(&mut step));
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    header();
    overheads(c);
    b3_chain(c);
    matmul(c);
    mlp_step(c);
}

criterion_group! {
    name = gpu_benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = benches
}
criterion_main!(gpu_benches);
