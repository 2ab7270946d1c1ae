//! Staging benchmarks, each beside its baseline in the same run:
//! - lazy recording cost per op, and a cached 1,000-op trace per step;
//! - the first compile of a fresh 1,000-op chain;
//! - lazy vs eager for an 8-op elementwise chain and an MLP training step
//!   (784-256-256-10, batch 128, hand-written backward, SGD);
//! - a staged function: steady call of a 1,000-op chain, instantiation of a
//!   1,000-node function, and the `while sum(x) >= 1 { x *= 0.9 }` loop as
//!   one While op vs the same loop driven from the host.
//!
//! Run with `scripts/bench.sh staging` for 2-thread and pinned 1-thread
//! figures.

mod common;
use common::{b3, mlp_batch, Mlp};
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use stagecraft::layers::graph::Function;
use stagecraft::layers::runtime::executor;
use stagecraft::{function, lazy, while_loop, Device, Tensor};
use std::sync::Arc;

fn lazy_recording(c: &mut Criterion) {
    let d = Device::lazy(&Device::cpu());
    let x = Tensor::<f32>::ones(&[4], &d);
    let mut g = c.benchmark_group("lazy_recording");
    g.bench_function("record_one_add", |b| b.iter(|| black_box(&x + &x)));
    let cpu = Device::cpu();
    let e = Tensor::<f32>::ones(&[4], &cpu);
    g.bench_function("eager_one_add", |b| b.iter(|| black_box(&e + &e)));
    g.finish();
}

fn chain(x: &Tensor<f32>, n: usize) -> Tensor<f32> {
    let mut c = x.clone();
    for _ in 0..n {
        c = &c + x;
    }
    c
}

fn lazy_traces(c: &mut Criterion) {
    let d = Device::lazy(&Device::cpu());
    let mut g = c.benchmark_group("lazy_1000_op_trace");
    g.sample_size(20);
    let x = Tensor::<f32>::from_vec(vec![1.0; 32], &[32], &d).unwrap();
    chain(&x, 1000).to_vec().unwrap();
    g.bench_function("record_and_run_cached", |b| {
        b.iter(|| chain(&x, 1000).to_vec().unwrap())
    });
    let mut n = 64;
    g.bench_function("first_compile_fresh_chain", |b| {
        b.iter(|| {
            // A new input length is a new trace: a cache miss every time.
            n += 1;
            let x = Tensor::<f32>::from_vec(vec![1.0; n], &[n], &d).unwrap();
            chain(&x, 1000).to_vec().unwrap()
        })
    });
    g.finish();
}

fn elementwise_chain(c: &mut Criterion) {
    const N: usize = 1 << 20;
    let mut g = c.benchmark_group("b3_chain_1M");
    g.sample_size(30);
    for (name, d) in [
        ("eager", Device::cpu()),
        ("lazy", Device::lazy(&Device::cpu())),
    ] {
        let x = Tensor::<f32>::from_vec(vec![0.5; N], &[N], &d).unwrap();
        g.bench_function(name, |b| b.iter(|| b3(&x).wait().unwrap()));
    }
    g.finish();
}

/// One SGD step of the MLP with the backward pass written out by hand.
fn manual_step(model: &mut Mlp, x: &Tensor<f32>, y: &Tensor<f32>, lr: f32) -> Tensor<f32> {
    let [w1, w2, w3] = &model.w;
    let [b1, b2, b3] = &model.b;
    let h1 = (x.matmul(w1) + b1).relu();
    let h2 = (h1.matmul(w2) + b2).relu();
    let logits = h2.matmul(w3) + b3;
    let logp = logits.log_softmax(-1);
    let loss = -(&logp * y).sum(&[-1], false).mean(&[0], false);
    let batch = x.dims()[0] as f32;
    let dlogits = (logp.exp() - y) * (1.0 / batch);
    let dw3 = h2.transpose(0, 1).matmul(&dlogits);
    let db3 = dlogits.sum(&[0], false);
    let dh2 = dlogits.matmul(&w3.transpose(0, 1))
        * h2.gt(&Tensor::scalar(0.0, &x.device())).cast::<f32>();
    let dw2 = h1.transpose(0, 1).matmul(&dh2);
    let db2 = dh2.sum(&[0], false);
    let dh1 =
        dh2.matmul(&w2.transpose(0, 1)) * h1.gt(&Tensor::scalar(0.0, &x.device())).cast::<f32>();
    let dw1 = x.transpose(0, 1).matmul(&dh1);
    let db1 = dh1.sum(&[0], false);
    let grads_w = [dw1, dw2, dw3];
    let grads_b = [db1, db2, db3];
    for i in 0..3 {
        model.w[i] = &model.w[i] - &(&grads_w[i] * lr);
        model.b[i] = &model.b[i] - &(&grads_b[i] * lr);
    }
    loss
}

fn mlp_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("mlp_784_256_256_10_b128");
    g.sample_size(30);
    for (name, d) in [
        ("eager", Device::cpu()),
        ("lazy", Device::lazy(&Device::cpu())),
    ] {
        let mut model = Mlp::new(&d);
        lazy::mark_step();
        let (x, y) = mlp_batch(&d);
        lazy::mark_step();
        g.bench_function(name, |b| {
            b.iter(|| {
                let loss = manual_step(&mut model, &x, &y, 0.01);
                lazy::mark_step();
                loss.wait().unwrap()
            })
        });
    }
    g.finish();
}

fn mlp_autodiff(c: &mut Criterion) {
    let mut g = c.benchmark_group("mlp_autodiff_784_256_256_10_b128");
    g.sample_size(30);
    for (name, d) in [
        ("eager", Device::cpu()),
        ("lazy", Device::lazy(&Device::cpu())),
    ] {
        let mut model = Mlp::new(&d);
        let (x, y) = mlp_batch(&d);
        lazy::mark_step();
        g.bench_function(name, |b| {
            b.iter(|| {
                let loss = model.autodiff_step(&x, &y, 0.01);
                lazy::mark_step();
                loss.wait().unwrap()
            })
        });
    }
    g.finish();
}

fn staged_functions(c: &mut Criterion) {
    let cpu = Device::cpu();
    let mut g = c.benchmark_group("function");
    let chain_fn = function(|x: Tensor<f32>| chain(&x, 1000));
    let x = Tensor::<f32>::from_vec(vec![1.0; 4], &[4], &cpu).unwrap();
    chain_fn.call(x.clone()).wait().unwrap();
    g.bench_function("steady_call_1000_op_chain", |b| {
        b.iter(|| chain_fn.call(x.clone()).wait().unwrap())
    });
    let traced: Arc<Function> = chain_fn.traced_function(&x).unwrap();
    g.bench_function("instantiate_1000_nodes", |b| {
        b.iter(|| executor::instantiate(traced.clone(), cpu).unwrap())
    });
    let one = Tensor::<f32>::scalar(1.0, &cpu);
    let start = Tensor::<f32>::full(&[1000], 0.194, &cpu);
    let staged_loop = function(|x: Tensor<f32>| {
        while_loop(
            x,
            |x| x.sum(&[0], false).ge(&Tensor::scalar(1.0, &Device::cpu())),
            |x| x * 0.9,
        )
    });
    staged_loop.call(start.clone()).wait().unwrap();
    g.bench_function("while_loop_staged", |b| {
        b.iter(|| staged_loop.call(start.clone()).wait().unwrap())
    });
    g.bench_function("while_loop_host_driven", |b| {
        b.iter(|| {
            let mut x = start.clone();
            while x.sum(&[0], false).ge(&one).item().unwrap() {
                x = x * 0.9;
            }
            x
        })
    });
    g.finish();
}

criterion_group!(
    benches,
    lazy_recording,
    lazy_traces,
    elementwise_chain,
    mlp_step,
    mlp_autodiff,
    staged_functions
);
criterion_main!(benches);
