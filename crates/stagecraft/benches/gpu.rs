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
//! submitted, before they run.
//!
//! `cargo bench -p stagecraft --features wgpu --bench gpu`

mod common;
use common::b3;
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

/// The B5 model's parameters.
struct Mlp {
    w: Vec<Tensor<f32>>,
    b: Vec<Tensor<f32>>,
}

impl Mlp {
    fn new(d: &Device) -> Mlp {
        let mut rng = Rng::new(0);
        let dims = [784, 256, 256, 10];
        let w = (0..3)
            .map(|i| Tensor::rand_normal(&[dims[i], dims[i + 1]], 0.0, 0.05, &mut rng, d))
            .collect();
        let b = (0..3).map(|i| Tensor::zeros(&[dims[i + 1]], d)).collect();
        Mlp { w, b }
    }

    /// One SGD step; the loss read on the host.
    fn step(&mut self, x: &Tensor<f32>, y: &Tensor<f32>, lr: f32) -> f32 {
        let w: Vec<Tensor<f32>> = self.w.iter().map(|t| t.requires_grad()).collect();
        let b: Vec<Tensor<f32>> = self.b.iter().map(|t| t.requires_grad()).collect();
        let h1 = (x.matmul(&w[0]) + &b[0]).relu();
        let h2 = (h1.matmul(&w[1]) + &b[1]).relu();
        let logits = h2.matmul(&w[2]) + &b[2];
        let loss = -(logits.log_softmax(-1) * y)
            .sum(&[-1], false)
            .mean(&[0], false);
        let grads = loss.backward().expect("differentiable");
        for i in 0..3 {
            self.w[i] = &w[i] - &(grads.get(&w[i]).expect("tracked") * lr);
            self.b[i] = &b[i] - &(grads.get(&b[i]).expect("tracked") * lr);
        }
        lazy::mark_step();
        loss.item().unwrap()
    }
}

fn mlp_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("gpu_B5_mlp_784_256_256_10_b128");
    for (name, d) in [("lazy", Device::lazy(&gpu())), ("eager", gpu())] {
        let mut model = Mlp::new(&d);
        let x = Tensor::<f32>::rand_uniform(&[128, 784], 0.0, 1.0, &mut Rng::new(1), &d);
        let labels: Vec<f32> = (0..1280)
            .map(|i| if i % 10 == (i / 10) % 10 { 1.0 } else { 0.0 })
            .collect();
        let y = Tensor::<f32>::from_vec(labels, &[128, 10], &d).unwrap();
        lazy::mark_step();
        for _ in 0..5 {
            model.step(&x, &y, 0.01);
        }
        group.bench_function(name, |bench| bench.iter(|| model.step(&x, &y, 0.01)));
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
