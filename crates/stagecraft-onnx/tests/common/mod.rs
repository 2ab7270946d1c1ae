//! Building small ONNX models in Rust with the protobuf types, shared by
//! the integration tests.

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

use prost::Message;
use stagecraft_onnx::encode_tensor;
use stagecraft_onnx::proto::{
    attribute_proto::AttributeType, tensor_proto::DataType, tensor_shape_proto, type_proto,
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorShapeProto,
    TypeProto, ValueInfoProto,
};
use stagecraft_tensor::DenseHostTensor;

pub fn value(name: &str, elem: DataType, dims: &[Option<i64>]) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(elem as i32),
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|d| tensor_shape_proto::Dimension {
                            value: Some(match d {
                                Some(n) => tensor_shape_proto::dimension::Value::DimValue(*n),
                                None => tensor_shape_proto::dimension::Value::DimParam("N".into()),
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

pub fn node(
    op: &str,
    name: &str,
    inputs: &[&str],
    outputs: &[&str],
    attrs: Vec<AttributeProto>,
) -> NodeProto {
    NodeProto {
        op_type: Some(op.into()),
        name: Some(name.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        attribute: attrs,
        ..Default::default()
    }
}

pub fn int_attr(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Int as i32),
        i: Some(v),
        ..Default::default()
    }
}

/// A tensor value of fixed shape.
pub fn fixed(name: &str, elem: DataType, dims: &[i64]) -> ValueInfoProto {
    let dims: Vec<Option<i64>> = dims.iter().map(|&n| Some(n)).collect();
    value(name, elem, &dims)
}

/// A graph named `g` with these nodes, inputs, outputs and initializers.
pub fn graph(
    nodes: Vec<NodeProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
    inits: Vec<(&str, DenseHostTensor)>,
) -> GraphProto {
    GraphProto {
        name: Some("g".into()),
        node: nodes,
        input: inputs,
        output: outputs,
        initializer: inits
            .iter()
            .map(|(n, t)| encode_tensor(n, t).unwrap())
            .collect(),
        ..Default::default()
    }
}

/// The serialized model of `graph` importing the default domain at `opset`.
pub fn model_bytes(graph: GraphProto, opset: i64) -> Vec<u8> {
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(opset),
        }],
        graph: Some(graph),
        ..Default::default()
    }
    .encode_to_vec()
}
