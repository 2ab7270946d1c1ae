//! Small models built in Rust with the protobuf types, serialized, loaded
//! and run: hand-computed results, the three modes agree, and bad input
//! gives clear errors.

use stagecraft_onnx::proto::{
    attribute_proto::AttributeType, tensor_proto::DataType, AttributeProto, NodeProto,
    ValueInfoProto,
};
use stagecraft_onnx::{Dim, Mode, Model, OnnxErrorKind};
use stagecraft_tensor::{DType, DenseHostTensor};

mod common;

use common::{int_attr, node, value};

fn model(
    nodes: Vec<NodeProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
    inits: Vec<(&str, DenseHostTensor)>,
    opset: i64,
) -> Vec<u8> {
    common::model_bytes(common::graph(nodes, inputs, outputs, inits), opset)
}

fn f32s(v: &[f32], shape: &[usize]) -> DenseHostTensor {
    DenseHostTensor::from_slice(v, shape).unwrap()
}

/// y = relu(x @ w + b), then reshaped to [-1] via a constant shape.
fn mlp() -> Vec<u8> {
    let w = f32s(&[1.0, -1.0, 2.0, 0.5, 0.0, 1.0], &[3, 2]);
    let b = f32s(&[0.5, -4.0], &[2]);
    let shape = DenseHostTensor::from_slice(&[-1i64], [1]).unwrap();
    model(
        vec![
            node("MatMul", "mm", &["x", "w"], &["xw"], vec![]),
            node("Add", "add", &["xw", "b"], &["z"], vec![]),
            node("Relu", "relu", &["z"], &["r"], vec![]),
            node("Reshape", "flat", &["r", "shape"], &["y"], vec![]),
        ],
        vec![value("x", DataType::Float, &[None, Some(3)])],
        vec![value("y", DataType::Float, &[None])],
        vec![("w", w), ("b", b), ("shape", shape)],
        13,
    )
}

#[test]
fn an_mlp_runs_in_every_mode_with_hand_computed_results() {
    let m = Model::from_bytes(&mlp()).unwrap();
    assert_eq!(m.opset(), 13);
    assert_eq!(m.inputs().len(), 1);
    assert_eq!(m.inputs()[0].dtype, Some(DType::F32));
    assert_eq!(
        m.inputs()[0].shape,
        Some(vec![Dim::Named("N".into()), Dim::Fixed(3)])
    );
    assert!(m.unsupported_ops().is_empty());
    // x = [[1, 2, 3], [-1, 0, 1]]
    // x @ w = [[1 + 4 + 0, -1 + 1 + 3], [-1 + 0 + 0, 1 + 0 + 1]] = [[5, 3], [-1, 2]]
    // + b = [[5.5, -1], [-0.5, -2]]; relu = [[5.5, 0], [0, 0]]
    let x = f32s(&[1.0, 2.0, 3.0, -1.0, 0.0, 1.0], &[2, 3]);
    for mode in [Mode::Eager, Mode::Lazy, Mode::Function] {
        let out = m.run_with(&[("x", x.clone())], mode).unwrap();
        assert_eq!(out[0].shape().dims(), &[4]);
        assert_eq!(
            out[0].to_vec::<f32>().unwrap(),
            vec![5.5, 0.0, 0.0, 0.0],
            "{mode:?}"
        );
    }
    // Another batch size traces another function.
    let x1 = f32s(&[0.0, 0.0, 4.0], &[1, 3]);
    let out = m.run(&[("x", x1)]).unwrap();
    // [0, 0, 4] @ w = [0, 4] + b = [0.5, 0]
    assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![0.5, 0.0]);
}

#[test]
fn conv_pool_and_softmax_agree_across_modes() {
    // 1x1x4x4 input, 2x1x3x3 filter of ones with pads 1, max pool 2x2,
    // global average pool, flatten, softmax.
    let w = f32s(&[1.0; 18], &[2, 1, 3, 3]);
    let bias = f32s(&[0.0, 1.0], &[2]);
    let ints = |name: &str, v: &[i64]| AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Ints as i32),
        ints: v.to_vec(),
        ..Default::default()
    };
    let bytes = model(
        vec![
            node(
                "Conv",
                "conv",
                &["x", "w", "bias"],
                &["c"],
                vec![ints("pads", &[1, 1, 1, 1]), ints("kernel_shape", &[3, 3])],
            ),
            node(
                "MaxPool",
                "pool",
                &["c"],
                &["p"],
                vec![ints("kernel_shape", &[2, 2]), ints("strides", &[2, 2])],
            ),
            node("GlobalAveragePool", "gap", &["p"], &["g"], vec![]),
            node("Flatten", "flat", &["g"], &["f"], vec![int_attr("axis", 1)]),
            node("Softmax", "sm", &["f"], &["y"], vec![int_attr("axis", 1)]),
        ],
        vec![value(
            "x",
            DataType::Float,
            &[Some(1), Some(1), Some(4), Some(4)],
        )],
        vec![value("y", DataType::Float, &[Some(1), Some(2)])],
        vec![("w", w), ("bias", bias)],
        11,
    );
    let m = Model::from_bytes(&bytes).unwrap();
    let x = f32s(
        &(0..16).map(|i| i as f32 / 16.0).collect::<Vec<_>>(),
        &[1, 1, 4, 4],
    );
    let results: Vec<Vec<f32>> = [Mode::Eager, Mode::Lazy, Mode::Function]
        .iter()
        .map(|&mode| {
            m.run_with(&[("x", x.clone())], mode).unwrap()[0]
                .to_vec::<f32>()
                .unwrap()
        })
        .collect();
    // The two channels differ by the bias 1 everywhere, so softmax gives
    // [1 / (1 + e), e / (1 + e)].
    let e = std::f32::consts::E;
    assert!(
        (results[0][0] - 1.0 / (1.0 + e)).abs() < 1e-6,
        "{results:?}"
    );
    assert!((results[0][1] - e / (1.0 + e)).abs() < 1e-6);
    assert_eq!(results[0], results[1]);
    assert_eq!(results[0], results[2]);
}

#[test]
fn bad_input_gives_clear_errors() {
    let bytes = mlp();
    // Truncated file.
    let e = Model::from_bytes(&bytes[..bytes.len() / 2]).unwrap_err();
    assert_eq!(e.kind(), OnnxErrorKind::Decode, "{e}");
    // Garbage.
    assert!(Model::from_bytes(&[0xff; 64]).is_err());
    let m = Model::from_bytes(&bytes).unwrap();
    // Missing input, unknown input, wrong shape, wrong dtype.
    let none: [(&str, DenseHostTensor); 0] = [];
    assert!(m
        .run(&none)
        .unwrap_err()
        .to_string()
        .contains("missing input 'x'"));
    let x = f32s(&[1.0; 6], &[2, 3]);
    let e = m.run(&[("x", x.clone()), ("z", x.clone())]).unwrap_err();
    assert!(e.to_string().contains("no input 'z'"), "{e}");
    let e = m.run(&[("x", f32s(&[1.0; 4], &[2, 2]))]).unwrap_err();
    assert!(
        e.to_string()
            .contains("has shape [2,2], the model expects [N, 3]"),
        "{e}"
    );
    let ints = DenseHostTensor::from_slice(&[1i64; 6], [2, 3]).unwrap();
    assert!(m
        .run(&[("x", ints)])
        .unwrap_err()
        .to_string()
        .contains("expects f32"));
    // An unknown op names the node, its type and opset.
    let bad = model(
        vec![node("FancyOp", "fancy", &["x"], &["y"], vec![])],
        vec![value("x", DataType::Float, &[Some(2)])],
        vec![value("y", DataType::Float, &[Some(2)])],
        vec![],
        17,
    );
    let m = Model::from_bytes(&bad).unwrap();
    assert_eq!(m.unsupported_ops(), vec!["FancyOp".to_string()]);
    let e = m.run(&[("x", f32s(&[1.0, 2.0], &[2]))]).unwrap_err();
    assert!(e.is_unsupported());
    assert!(
        e.to_string()
            .starts_with("node 'fancy' (FancyOp, opset 17): unsupported"),
        "{e}"
    );
    // An opset from the future.
    let future = model(vec![], vec![], vec![], vec![], 99);
    assert!(Model::from_bytes(&future).unwrap_err().is_unsupported());
    // A shape error inside an op names the node.
    let mismatched = model(
        vec![node("Add", "plus", &["x", "w"], &["y"], vec![])],
        vec![value("x", DataType::Float, &[Some(3)])],
        vec![value("y", DataType::Float, &[Some(3)])],
        vec![("w", f32s(&[1.0, 2.0], &[2]))],
        13,
    );
    let e = Model::from_bytes(&mismatched)
        .unwrap()
        .run(&[("x", f32s(&[1.0; 3], &[3]))])
        .unwrap_err();
    assert!(
        e.to_string().starts_with("node 'plus' (Add, opset 13)"),
        "{e}"
    );
}

#[test]
fn load_reads_a_file_and_reports_missing_ones() {
    let dir = std::env::temp_dir().join(format!("stagecraft-onnx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("mlp.onnx");
    std::fs::write(&path, mlp()).unwrap();
    let m = Model::load(&path).unwrap();
    assert_eq!(m.op_counts().len(), 4);
    let e = Model::load(dir.join("nope.onnx")).unwrap_err();
    assert_eq!(e.kind(), OnnxErrorKind::Io);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn mutated_models_never_panic() {
    // Every truncation and a spread of single-byte corruptions of a valid
    // model: loading and running either works or returns an error.
    let bytes = mlp();
    let x = f32s(&[1.0, 2.0, 3.0, -1.0, 0.0, 1.0], &[2, 3]);
    let try_run = |b: &[u8]| {
        std::panic::catch_unwind(|| {
            if let Ok(m) = Model::from_bytes(b) {
                let _ = m.run_with(&[("x", x.clone())], Mode::Eager);
            }
        })
        .is_ok()
    };
    for len in 0..bytes.len() {
        assert!(try_run(&bytes[..len]), "truncated to {len} bytes");
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..2000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let mut b = bytes.clone();
        let i = (state % b.len() as u64) as usize;
        b[i] = (state >> 32) as u8;
        assert!(try_run(&b), "byte {i} set to {}", b[i]);
    }
}

#[test]
fn integer_data_inputs_stay_inputs_and_shape_inputs_are_baked() {
    // y = Reshape(Gather(table, ids), shape): `ids` is data (one function
    // serves every value), `shape` sets a shape (baked per call).
    let table = f32s(&[10.0, 11.0, 20.0, 21.0, 30.0, 31.0], &[3, 2]);
    let bytes = model(
        vec![
            node("Gather", "embed", &["table", "ids"], &["g"], vec![]),
            node("Reshape", "flat", &["g", "shape"], &["y"], vec![]),
        ],
        vec![
            value("ids", DataType::Int64, &[Some(2)]),
            value("shape", DataType::Int64, &[Some(1)]),
        ],
        vec![value("y", DataType::Float, &[None])],
        vec![("table", table)],
        13,
    );
    let m = Model::from_bytes(&bytes).unwrap();
    let ids = |v: [i64; 2]| DenseHostTensor::from_slice(&v, [2]).unwrap();
    let shape = DenseHostTensor::from_slice(&[4i64], [1]).unwrap();
    for mode in [Mode::Eager, Mode::Lazy, Mode::Function] {
        for (v, want) in [
            ([2, 0], vec![30.0, 31.0, 10.0, 11.0]),
            ([1, 1], vec![20.0, 21.0, 20.0, 21.0]),
        ] {
            let out = m
                .run_with(&[("ids", ids(v)), ("shape", shape.clone())], mode)
                .unwrap();
            assert_eq!(out[0].to_vec::<f32>().unwrap(), want, "{mode:?} {v:?}");
        }
    }
}
