//! B8: inference of the nine `light/` models of the onnx 1.22.0 test data
//! (AlexNet, DenseNet-121, Inception v1/v2, ResNet-50, ShuffleNet,
//! SqueezeNet, VGG-19, ZFNet-512: real architectures with constant-filled
//! weights) at batch 1, input `arange(n).reshape(shape) / n`, staged as a
//! graph function ([`Mode::Function`]) — the same runs as
//! `../shared/peers/bench_onnx_ort.py` times in onnxruntime.
//!
//! Before the rows the bench prints, per model, the load time (decode and
//! validate) and the first run (trace, optimize, compile, run), as the
//! peer reports its session creation.
//!
//! The data comes from `data/onnx` (or `$STAGECRAFT_ONNX_DATA`), fetched
//! on first use like the conformance suite's. `STAGECRAFT_B8_MODELS=resnet50,squeezenet`
//! runs a subset. Run on both cores and on one pinned core:
//! `RAYON_NUM_THREADS=2 cargo bench -p stagecraft-onnx --bench light_models` and
//! `RAYON_NUM_THREADS=1 taskset -c 0 cargo bench -p stagecraft-onnx --bench light_models`.

use criterion::{criterion_group, criterion_main, Criterion};
use stagecraft_onnx::conformance::{data_dir, ensure_data};
use stagecraft_onnx::{Dim, Mode, Model};
use stagecraft_tensor::DenseHostTensor;
use std::path::Path;
use std::time::{Duration, Instant};

const MODELS: [&str; 9] = [
    "bvlc_alexnet",
    "densenet121",
    "inception_v1",
    "inception_v2",
    "resnet50",
    "shufflenet",
    "squeezenet",
    "vgg19",
    "zfnet512",
];

/// The runner's input: `arange(n).reshape(shape) / n` in f32, with open
/// dimensions taken as 1 (batch 1).
fn input(model: &Model) -> (String, DenseHostTensor) {
    let info = &model.inputs()[0];
    let dims: Vec<usize> = info
        .shape
        .as_deref()
        .unwrap_or(&[])
        .iter()
        .map(|d| match d {
            Dim::Fixed(n) => *n,
            _ => 1,
        })
        .collect();
    let n: usize = dims.iter().product();
    let values: Vec<f32> = (0..n).map(|i| i as f32 / n as f32).collect();
    let x = DenseHostTensor::from_slice(&values, dims).expect("the declared shape");
    (info.name.clone(), x)
}

fn benches(c: &mut Criterion) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/onnx");
    let dir = data_dir(None, &root);
    ensure_data(&dir).expect("the ONNX test data (see crates/stagecraft-onnx/src/conformance.rs)");
    let only = std::env::var("STAGECRAFT_B8_MODELS").ok();
    let mut group = c.benchmark_group("B8");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    for net in MODELS {
        if only
            .as_deref()
            .is_some_and(|o| !o.split(',').any(|m| net.contains(m)))
        {
            continue;
        }
        let path = dir.join("light").join(format!("light_{net}.onnx"));
        let t0 = Instant::now();
        let model = Model::load(&path).expect("a light model");
        let load = t0.elapsed();
        let (name, x) = input(&model);
        let t1 = Instant::now();
        model
            .run_with(&[(name.as_str(), x.clone())], Mode::Function)
            .expect("the first run");
        let first = t1.elapsed();
        println!(
            "B8 {net}: load {:.3} s, first run {:.3} s",
            load.as_secs_f64(),
            first.as_secs_f64()
        );
        group.bench_function(net, |b| {
            b.iter(|| {
                model
                    .run_with(&[(name.as_str(), x.clone())], Mode::Function)
                    .unwrap()
            })
        });
    }
    group.finish();
}

criterion_group!(b8, benches);
criterion_main!(b8);
