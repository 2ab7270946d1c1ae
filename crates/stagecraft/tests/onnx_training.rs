//! An imported ONNX model is a differentiable stagecraft function:
//! gradients through it match the same computation written with
//! stagecraft's ops, `optim` fine-tunes its initializers, and the
//! fine-tuned weights are written back to an `.onnx` file that imports
//! again with the same results.

use stagecraft::layers::tensor::DenseHostTensor;
mod common;

use stagecraft::nn::{Module, ModuleExt};
use stagecraft::onnx::proto::{
    attribute_proto::AttributeType, tensor_proto::DataType, tensor_shape_proto, type_proto,
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorShapeProto,
    TypeProto, ValueInfoProto,
};
use stagecraft::onnx::{encode_tensor, Model, OnnxModule};
use stagecraft::optim::{Adam, AdamConfig, Optimizer};
use stagecraft::{CrossEntropyOptions, Device, Tensor};

fn value(name: &str, dims: &[i64]) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(DataType::Float as i32),
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|&d| tensor_shape_proto::Dimension {
                            value: Some(if d < 0 {
                                tensor_shape_proto::dimension::Value::DimParam("batch".into())
                            } else {
                                tensor_shape_proto::dimension::Value::DimValue(d)
                            }),
                            ..Default::default()
                        })
                        .collect(),
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn gemm(name: &str, inputs: &[&str], output: &str) -> NodeProto {
    NodeProto {
        op_type: Some("Gemm".into()),
        name: Some(name.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: vec![output.into()],
        attribute: vec![AttributeProto {
            name: Some("transB".into()),
            r#type: Some(AttributeType::Int as i32),
            i: Some(1),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn unary(op: &str, input: &str, output: &str) -> NodeProto {
    NodeProto {
        op_type: Some(op.into()),
        name: Some(format!("{op}_0")),
        input: vec![input.into()],
        output: vec![output.into()],
        ..Default::default()
    }
}

/// Deterministic values in [-scale, scale).
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    common::values(n, seed, -scale as f64, scale as f64)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

fn init(name: &str, dims: &[usize], v: &[f32]) -> stagecraft::onnx::proto::TensorProto {
    encode_tensor(name, &DenseHostTensor::from_slice(v, dims).unwrap()).unwrap()
}

/// A classifier as an exporter writes one: `Gemm → Relu → Gemm` from
/// `input: [batch, 4]` to `logits: [batch, 3]`, weights stored
/// `[out, in]` (transB), opset 17.
fn classifier() -> (ModelProto, Vec<(String, Vec<f32>)>) {
    let weights = vec![
        ("fc1.weight".to_string(), values(8 * 4, 1, 0.5)),
        ("fc1.bias".to_string(), values(8, 2, 0.1)),
        ("fc2.weight".to_string(), values(3 * 8, 3, 0.5)),
        ("fc2.bias".to_string(), values(3, 4, 0.1)),
    ];
    let dims: [&[usize]; 4] = [&[8, 4], &[8], &[3, 8], &[3]];
    let graph = GraphProto {
        name: Some("classifier".into()),
        node: vec![
            gemm("fc1", &["input", "fc1.weight", "fc1.bias"], "h"),
            unary("Relu", "h", "a"),
            gemm("fc2", &["a", "fc2.weight", "fc2.bias"], "logits"),
        ],
        initializer: weights
            .iter()
            .zip(dims)
            .map(|((n, v), d)| init(n, d, v))
            .collect(),
        input: vec![value("input", &[-1, 4])],
        output: vec![value("logits", &[-1, 3])],
        ..Default::default()
    };
    let model = ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(17),
        }],
        graph: Some(graph),
        ..Default::default()
    };
    (model, weights)
}

/// Three well-separated clusters in 4-D, `n` points each.
fn dataset(n: usize) -> (Vec<f32>, Vec<i64>) {
    let centers = [
        [2.0, 0.0, -1.0, 1.0],
        [-2.0, 1.0, 1.0, 0.0],
        [0.0, -2.0, 0.5, -1.5],
    ];
    let noise = values(3 * n * 4, 9, 0.6);
    let mut x = Vec::new();
    let mut y = Vec::new();
    for i in 0..3 * n {
        let c = i % 3;
        for d in 0..4 {
            x.push(centers[c][d] + noise[i * 4 + d]);
        }
        y.push(c as i64);
    }
    (x, y)
}

fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
}

#[test]
fn gradients_through_an_imported_model_match_the_same_ops_written_directly() {
    let cpu = Device::cpu();
    let (proto, weights) = classifier();
    let net = OnnxModule::new(Model::from_proto(proto).unwrap(), &cpu);
    let names: Vec<String> = net.named_params().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"],
        "the float initializers become parameters, sorted by name"
    );
    let (xs, _) = dataset(2);
    let x = Tensor::<f32>::from_slice(&xs, &[6, 4], &cpu)
        .unwrap()
        .requires_grad();
    net.requires_grad();
    let logits = net.forward(&[("input", &x)]).unwrap().remove(0);
    let loss = (&logits * &logits).sum(&[], false);
    let grads = loss.backward().unwrap();

    // The same model with stagecraft's ops.
    let w = |i: usize, dims: &[usize]| {
        Tensor::<f32>::from_slice(&weights[i].1, dims, &cpu)
            .unwrap()
            .requires_grad()
    };
    let (w1, b1, w2, b2) = (w(0, &[8, 4]), w(1, &[8]), w(2, &[3, 8]), w(3, &[3]));
    let x2 = Tensor::<f32>::from_slice(&xs, &[6, 4], &cpu)
        .unwrap()
        .requires_grad();
    let h = (x2.matmul(&w1.transpose(0, 1)) + &b1).relu();
    let direct = h.matmul(&w2.transpose(0, 1)) + &b2;
    let direct_loss = (&direct * &direct).sum(&[], false);
    let direct_grads = direct_loss.backward().unwrap();

    assert!(close(
        &logits.to_vec().unwrap(),
        &direct.to_vec().unwrap(),
        1e-5
    ));
    let params = net.named_params();
    for ((name, p), d) in params.iter().zip([&b1, &w1, &b2, &w2]) {
        let g = grads
            .get(p)
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let want = direct_grads.get(d).unwrap();
        assert!(
            close(&g.to_vec().unwrap(), &want.to_vec().unwrap(), 1e-4),
            "gradient of {name}"
        );
    }
    let gx = grads.get(&x).expect("a gradient for the model's input");
    assert!(close(
        &gx.to_vec().unwrap(),
        &direct_grads.get(&x2).unwrap().to_vec().unwrap(),
        1e-4
    ));
}

#[test]
fn adam_fine_tunes_an_imported_classifier_and_the_result_exports_and_reimports() {
    let cpu = Device::cpu();
    let (proto, _) = classifier();
    let mut net = OnnxModule::new(Model::from_proto(proto).unwrap(), &cpu);
    let (xs, ys) = dataset(20);
    let x = Tensor::<f32>::from_slice(&xs, &[60, 4], &cpu).unwrap();
    let y = Tensor::<i64>::from_slice(&ys, &[60], &cpu).unwrap();
    let mut opt = Adam::new(AdamConfig {
        lr: 0.05,
        ..Default::default()
    });
    let accuracy = |net: &OnnxModule| {
        let logits = net.forward(&[("input", &x)]).unwrap().remove(0);
        let pred = logits.argmax(1, false).to_vec().unwrap();
        pred.iter().zip(&ys).filter(|(p, y)| p == y).count() as f64 / ys.len() as f64
    };
    let mut losses = Vec::new();
    for _ in 0..40 {
        net.requires_grad();
        let logits = net.forward(&[("input", &x)]).unwrap().remove(0);
        let loss = logits.cross_entropy(&y, CrossEntropyOptions::default());
        losses.push(loss.item().unwrap());
        let grads = loss.backward().unwrap();
        opt.step(&mut net, &grads).unwrap();
    }
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(
        last < 0.2 * first,
        "fine-tuning lowers the loss: {first} -> {last} ({losses:?})"
    );
    assert!(accuracy(&net) >= 0.95, "accuracy {}", accuracy(&net));

    // Written back with the trained weights, the file imports and runs
    // like the module it came from.
    let bytes = net.to_bytes().unwrap();
    let reloaded = Model::from_bytes(&bytes).unwrap();
    let want = net
        .forward(&[("input", &x)])
        .unwrap()
        .remove(0)
        .to_vec()
        .unwrap();
    let got = reloaded.run(&[("input", x.clone())]).unwrap();
    assert!(close(got[0].as_slice::<f32>().unwrap(), &want, 1e-6));
    let mut reloaded_params = Vec::new();
    OnnxModule::new(reloaded, &cpu).visit_params("", &mut |n, t| {
        reloaded_params.push((n.to_string(), t.to_vec().unwrap()))
    });
    for ((name, t), (rname, rv)) in net.named_params().iter().zip(&reloaded_params) {
        assert_eq!(name, rname);
        assert_eq!(&t.to_vec().unwrap(), rv, "{name} was written back");
    }
}

#[test]
fn a_lazy_forward_and_backward_match_the_eager_ones() {
    let cpu = Device::cpu();
    let lazy = Device::lazy(&cpu);
    let (proto, _) = classifier();
    let model = Model::from_proto(proto.clone()).unwrap();
    let (xs, ys) = dataset(3);
    let run = |device: &Device, model: Model| {
        let net = OnnxModule::new(model, device);
        net.requires_grad();
        let x = Tensor::<f32>::from_slice(&xs, &[9, 4], device).unwrap();
        let y = Tensor::<i64>::from_slice(&ys, &[9], device).unwrap();
        let logits = net.forward(&[("input", &x)]).unwrap().remove(0);
        let loss = logits.cross_entropy(&y, CrossEntropyOptions::default());
        let grads = loss.backward().unwrap();
        let mut out = vec![loss.to_vec().unwrap()];
        for (_, p) in net.named_params() {
            out.push(grads.get(&p).unwrap().to_vec().unwrap());
        }
        out
    };
    let eager = run(&cpu, model);
    let staged = run(&lazy, Model::from_proto(proto).unwrap());
    for (a, b) in eager.iter().zip(&staged) {
        assert!(close(a, b, 1e-5), "{a:?} vs {b:?}");
    }
}

#[test]
fn bad_inputs_to_a_module_name_the_input() {
    let cpu = Device::cpu();
    let (proto, _) = classifier();
    let net = OnnxModule::new(Model::from_proto(proto).unwrap(), &cpu);
    let wrong = Tensor::<f32>::zeros(&[2, 5], &cpu);
    let err = net.forward(&[("input", &wrong)]).unwrap_err();
    assert!(err.to_string().contains("input 'input' has shape"), "{err}");
    let err = net.forward(&[("image", &wrong)]).unwrap_err();
    assert!(err.to_string().contains("no input 'image'"), "{err}");
}
