//! `stagecraft::onnx::export`: staged functions written as ONNX models,
//! imported again and run in every mode, with the function's own results.
//!
//! With `STAGECRAFT_ONNX_EXPORT_DIR=dir`, each case also writes its model,
//! input and expected output there (`<case>.onnx`, `<case>_input_<i>.pb`,
//! `<case>_output_<i>.pb`) for `scripts/onnx_export_ort.sh`, which runs
//! them in onnxruntime.

mod common;

use stagecraft::layers::tensor::DenseHostTensor;
use stagecraft::nn::{CausalSelfAttention, Conv2d, Forward, LayerNorm, Linear};
use stagecraft::onnx::{self, encode_tensor, Mode, Model};
use stagecraft::{
    cond, function, while_loop, Conv2dOptions, Device, Pool2dOptions, Rng, StagedFunction, Tensor,
};

fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
}

fn input(dims: &[usize], seed: u64) -> Tensor<f32> {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = common::values(n, seed, -1.0, 1.0)
        .into_iter()
        .map(|v| v as f32)
        .collect();
    Tensor::from_vec(v, dims, &Device::cpu()).unwrap()
}

/// A tensor as `onnx.load_tensor` reads it: one encoded TensorProto.
fn write_pb(path: std::path::PathBuf, t: &DenseHostTensor) {
    use prost::Message;
    let proto = encode_tensor("", t).unwrap();
    std::fs::write(path, proto.encode_to_vec()).unwrap();
}

/// Exports `f` (called once on `x`), imports the model, runs it eagerly,
/// lazily and as a function, and compares each with `f`'s own result.
fn round_trip<F>(case: &str, f: &StagedFunction<Tensor<f32>, Tensor<f32>, F>, x: Tensor<f32>)
where
    F: Fn(Tensor<f32>) -> Tensor<f32>,
{
    let want = f.call(x.clone()).to_vec().unwrap();
    let bytes = onnx::export_to_bytes(f).unwrap();
    let model = Model::from_bytes(&bytes).unwrap();
    assert_eq!(model.inputs()[0].name, "input_0");
    for mode in [Mode::Function, Mode::Eager, Mode::Lazy] {
        let got = model.run_with(&[("input_0", x.clone())], mode).unwrap();
        let got = got[0].as_slice::<f32>().unwrap();
        assert!(
            close(got, &want, 1e-5),
            "{case} in {mode:?}: {got:?} vs {want:?}"
        );
    }
    if let Ok(dir) = std::env::var("STAGECRAFT_ONNX_EXPORT_DIR") {
        let dir = std::path::PathBuf::from(dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("{case}.onnx")), &bytes).unwrap();
        let host = |t: &Tensor<f32>| {
            DenseHostTensor::from_slice(&t.to_vec().unwrap(), t.dims().to_vec()).unwrap()
        };
        write_pb(dir.join(format!("{case}_input_0.pb")), &host(&x));
        write_pb(dir.join(format!("{case}_output_0.pb")), &host(&f.call(x)));
    }
}

#[test]
fn an_mlp_classifier_round_trips() {
    let cpu = Device::cpu();
    let mut rng = Rng::new(1);
    let l1 = Linear::new(6, 16, true, &mut rng, &cpu);
    let l2 = Linear::new(16, 4, true, &mut rng, &cpu);
    let f = function(move |x: Tensor<f32>| l2.forward(&l1.forward(&x).relu()).log_softmax(-1));
    round_trip("mlp", &f, input(&[5, 6], 2));
}

#[test]
fn a_cnn_round_trips() {
    let cpu = Device::cpu();
    let mut rng = Rng::new(3);
    let conv = Conv2d::new(
        2,
        4,
        [3, 3],
        Conv2dOptions {
            padding: [1, 1],
            ..Default::default()
        },
        true,
        &mut rng,
        &cpu,
    );
    let fc = Linear::new(4 * 4 * 4, 3, true, &mut rng, &cpu);
    let f = function(move |x: Tensor<f32>| {
        let h = conv
            .forward(&x)
            .relu()
            .max_pool2d(Pool2dOptions::new([2, 2]));
        let n = h.dims()[0];
        fc.forward(&h.reshape(&[n, 64])).softmax(-1)
    });
    round_trip("cnn", &f, input(&[2, 2, 8, 8], 4));
}

#[test]
fn a_transformer_block_round_trips() {
    let cpu = Device::cpu();
    let mut rng = Rng::new(5);
    let ln1 = LayerNorm::new(16, true, &cpu);
    let attn = CausalSelfAttention::new(16, 2, true, 0.0, &mut rng, &cpu);
    let ln2 = LayerNorm::new(16, true, &cpu);
    let up = Linear::new(16, 32, true, &mut rng, &cpu);
    let down = Linear::new(32, 16, true, &mut rng, &cpu);
    let f = function(move |x: Tensor<f32>| {
        let h = &x + &attn.forward(&ln1.forward(&x));
        &h + &down.forward(&up.forward(&ln2.forward(&h)).gelu())
    });
    round_trip("transformer_block", &f, input(&[2, 5, 16], 6));
}

#[test]
fn branches_and_loops_become_if_and_loop() {
    let f = function(|x: Tensor<f32>| {
        let zero = Tensor::scalar(0.0f32, &Device::cpu());
        let one = Tensor::scalar(1.0f32, &Device::cpu());
        let positive = x.sum(&[], false).gt(&zero);
        let y = cond(&positive, || x.exp(), || x.abs() * 2.0);
        // Halve until the largest magnitude is below 1.
        while_loop(y, |y| y.abs().max(&[], false).gt(&one), |y| y * 0.5)
    });
    round_trip("control_flow", &f, input(&[3, 4], 7));
    round_trip("control_flow_negative", &f, input(&[3, 4], 7) - 3.0);
}

#[test]
fn exporting_needs_one_traced_signature() {
    let f = function(|x: Tensor<f32>| x.exp());
    let err = onnx::export_to_bytes(&f).unwrap_err();
    assert!(err.to_string().contains("not been traced"), "{err}");
    f.call(input(&[2], 1));
    f.call(input(&[3], 1));
    let err = onnx::export_to_bytes(&f).unwrap_err();
    assert!(err.to_string().contains("2 input signatures"), "{err}");
}

#[test]
fn an_op_without_an_onnx_equivalent_is_named_with_its_line() {
    let f = function(|x: Tensor<f32>| x.sort(-1, false).0);
    f.call(input(&[4], 1));
    let err = onnx::export_to_bytes(&f).unwrap_err().to_string();
    assert!(err.contains("Sort"), "{err}");
    assert!(err.contains("onnx_export.rs"), "{err}");
}

#[test]
fn several_results_become_several_outputs() {
    let f = function(|x: Tensor<f32>| (x.exp(), x.tanh()));
    let x = input(&[3], 9);
    let (a, b) = f.call(x.clone());
    let model = Model::from_bytes(&onnx::export_to_bytes(&f).unwrap()).unwrap();
    let out = model.run(&[("input_0", x)]).unwrap();
    assert_eq!(out.len(), 2);
    assert!(close(
        out[0].as_slice::<f32>().unwrap(),
        &a.to_vec().unwrap(),
        1e-6
    ));
    assert!(close(
        out[1].as_slice::<f32>().unwrap(),
        &b.to_vec().unwrap(),
        1e-6
    ));
}

/// Causal attention with more queries than keys, in both layouts: the
/// exported mask aligns at the upper left as the op does (query `i` sees
/// keys `0..=i`; aligned at the end, the first queries would see none).
#[test]
fn causal_attention_with_fewer_keys_than_queries_round_trips() {
    let (k, v) = (input(&[1, 2, 3, 4], 8), input(&[1, 2, 3, 4], 9));
    let (k_bthd, v_bthd) = (k.transpose(1, 2), v.transpose(1, 2));
    let f = function(move |q: Tensor<f32>| q.scaled_dot_product_attention(&k, &v, true, None));
    round_trip("attention_t_over_s", &f, input(&[1, 2, 5, 4], 10));
    let f = function(move |q: Tensor<f32>| {
        q.scaled_dot_product_attention_bthd(&k_bthd, &v_bthd, true, None)
    });
    round_trip("attention_bthd_t_over_s", &f, input(&[1, 5, 2, 4], 10));
}
