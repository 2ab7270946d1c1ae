//! The node suite's control-flow cases (`If`, `Loop`, `Scan`) in every
//! mode: the functional `If`/`While` ops agree eagerly, lazily and staged.

use stagecraft_onnx::conformance::{self, Outcome};
use stagecraft_onnx::Mode;
use std::path::PathBuf;

mod common;

#[test]
fn control_flow_cases() {
    if std::env::var_os("STAGECRAFT_ONNX_SKIP_CONFORMANCE").is_some() {
        eprintln!("SKIPPED: STAGECRAFT_ONNX_SKIP_CONFORMANCE is set");
        return;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/onnx");
    let root = conformance::data_dir(None, &root);
    conformance::ensure_data(&root).expect("the ONNX conformance data");
    let cases = conformance::cases(&root, "node").expect("the node suite");
    let mut outcomes = Vec::new();
    for case in cases.iter().filter(|c| {
        ["test_if", "test_loop", "test_scan"]
            .iter()
            .any(|p| c.id.starts_with(&format!("node/{p}")))
    }) {
        for mode in [Mode::Function, Mode::Eager, Mode::Lazy] {
            let r = conformance::run_case(case, mode);
            eprintln!("{} {mode:?}: {:?}", case.id, r.outcome);
            outcomes.push((case.id.clone(), mode, r.outcome));
        }
    }
    for name in ["node/test_if", "node/test_scan9_sum"] {
        for (n, mode, o) in &outcomes {
            if n == name {
                assert_eq!(*o, Outcome::Pass, "{n} {mode:?}");
            }
        }
    }
}

mod built {
    //! Loops built in Rust: a counted loop with a scan output, and one that
    //! runs until its body's condition fails, in every mode.

    use stagecraft_onnx::proto::{
        attribute_proto::AttributeType, tensor_proto::DataType, AttributeProto, GraphProto,
        NodeProto, ValueInfoProto,
    };
    use stagecraft_onnx::{Mode, Model};
    use stagecraft_tensor::{DenseHostTensor, Shape};

    fn value(name: &str, elem: DataType, dims: &[i64]) -> ValueInfoProto {
        super::common::fixed(name, elem, dims)
    }

    /// A node named after its first output.
    fn node(
        op: &str,
        inputs: &[&str],
        outputs: &[&str],
        attribute: Vec<AttributeProto>,
    ) -> NodeProto {
        super::common::node(op, outputs[0], inputs, outputs, attribute)
    }

    use super::common::graph;

    fn model(g: GraphProto) -> Model {
        Model::from_bytes(&super::common::model_bytes(g, 16)).unwrap()
    }

    fn body_attr(g: GraphProto) -> AttributeProto {
        AttributeProto {
            name: Some("body".into()),
            r#type: Some(AttributeType::Graph as i32),
            g: Some(g),
            ..Default::default()
        }
    }

    fn scalar_f32(v: f32) -> DenseHostTensor {
        DenseHostTensor::from_slice(&[v], Shape::scalar()).unwrap()
    }

    #[test]
    fn a_counted_loop_stacks_its_scan_output() {
        // y = y * 2 four times; each iteration also emits y + i.
        let body = graph(
            vec![
                node("Mul", &["y_in", "two"], &["y_out"], vec![]),
                node("Identity", &["cond_in"], &["cond_out"], vec![]),
                node(
                    "Cast",
                    &["i"],
                    &["fi"],
                    vec![AttributeProto {
                        name: Some("to".into()),
                        r#type: Some(AttributeType::Int as i32),
                        i: Some(DataType::Float as i64),
                        ..Default::default()
                    }],
                ),
                node("Add", &["y_out", "fi"], &["s"], vec![]),
            ],
            vec![
                value("i", DataType::Int64, &[]),
                value("cond_in", DataType::Bool, &[]),
                value("y_in", DataType::Float, &[2]),
            ],
            vec![
                value("cond_out", DataType::Bool, &[]),
                value("y_out", DataType::Float, &[2]),
                value("s", DataType::Float, &[2]),
            ],
            vec![("two", scalar_f32(2.0))],
        );
        let m = model(graph(
            vec![node(
                "Loop",
                &["m", "c", "y0"],
                &["y", "ys"],
                vec![body_attr(body)],
            )],
            vec![value("y0", DataType::Float, &[2])],
            vec![
                value("y", DataType::Float, &[2]),
                value("ys", DataType::Float, &[4, 2]),
            ],
            vec![
                (
                    "m",
                    DenseHostTensor::from_slice(&[4i64], Shape::scalar()).unwrap(),
                ),
                (
                    "c",
                    DenseHostTensor::from_slice(&[true], Shape::scalar()).unwrap(),
                ),
            ],
        ));
        let y0 = DenseHostTensor::from_slice(&[1.0f32, 2.0], [2]).unwrap();
        for mode in [Mode::Function, Mode::Eager, Mode::Lazy] {
            let out = m.run_with(&[("y0", y0.clone())], mode).unwrap();
            assert_eq!(
                out[0].to_vec::<f32>().unwrap(),
                vec![16.0, 32.0],
                "{mode:?}"
            );
            assert_eq!(out[1].shape().dims(), &[4, 2]);
            assert_eq!(
                out[1].to_vec::<f32>().unwrap(),
                vec![2.0, 4.0, 5.0, 9.0, 10.0, 18.0, 19.0, 35.0],
                "{mode:?}"
            );
        }
    }

    #[test]
    fn a_loop_runs_until_its_condition_fails() {
        // y doubles while y < limit (a graph input, so one traced While
        // serves every limit).
        let body = graph(
            vec![
                node("Mul", &["y_in", "two"], &["y_out"], vec![]),
                node("Less", &["y_out", "limit"], &["cond_out"], vec![]),
            ],
            vec![
                value("i", DataType::Int64, &[]),
                value("cond_in", DataType::Bool, &[]),
                value("y_in", DataType::Float, &[]),
            ],
            vec![
                value("cond_out", DataType::Bool, &[]),
                value("y_out", DataType::Float, &[]),
            ],
            vec![("two", scalar_f32(2.0))],
        );
        let m = model(graph(
            vec![node(
                "Loop",
                &["", "c", "y0"],
                &["y"],
                vec![body_attr(body)],
            )],
            vec![
                value("y0", DataType::Float, &[]),
                value("limit", DataType::Float, &[]),
            ],
            vec![value("y", DataType::Float, &[])],
            vec![(
                "c",
                DenseHostTensor::from_slice(&[true], Shape::scalar()).unwrap(),
            )],
        ));
        for mode in [Mode::Function, Mode::Eager, Mode::Lazy] {
            for (limit, want) in [(20.0f32, 32.0f32), (3.0, 4.0)] {
                let out = m
                    .run_with(
                        &[("y0", scalar_f32(1.0)), ("limit", scalar_f32(limit))],
                        mode,
                    )
                    .unwrap();
                assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![want], "{mode:?}");
            }
        }
    }
}
