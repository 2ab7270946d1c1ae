//! Writing a stagecraft graph [`Function`] as an ONNX model.
//!
//! Each node becomes one ONNX node, or a few where ONNX has no single op
//! for it (`Rsqrt` is `Reciprocal(Sqrt)`, GELU is written with `Erf`,
//! attention as matmuls and a softmax), so that the model runs in any
//! runtime that implements opset [`EXPORT_OPSET`]. `Call`s are inlined,
//! `If` becomes an ONNX `If` with the branches as subgraphs and `While` a
//! `Loop` whose body also computes the next condition. Constants become
//! initializers, and so do nodes without inputs (`Fill`, `Arange`), which
//! are evaluated while exporting. An op with no ONNX equivalent (random
//! ops, host callbacks, gradient-only kernels) is an error naming it and
//! the user's line that created it.

use crate::error::{OnnxError, Result};
use crate::proto::attribute_proto::AttributeType;
use crate::proto::{
    tensor_shape_proto, type_proto, AttributeProto, GraphProto, ModelProto, NodeProto,
    OperatorSetIdProto, TensorShapeProto, TypeProto, ValueInfoProto,
};
use crate::tensor::{encode, onnx_type_of};
use prost::Message;
use stagecraft_graph::{Function, Node, NodeOp, Value};
use stagecraft_ops::{Attrs, FrozenOpAttrs, OpDef};
use stagecraft_runtime::{execute, Device};
use stagecraft_tensor::{DType, DenseHostTensor, Scalar, TensorMetadata};
use std::collections::HashMap;

/// The opset exported models import: the newest that onnxruntime 1.20 and
/// later run in full, and new enough for `axes` as inputs of every
/// reduction.
pub const EXPORT_OPSET: i64 = 18;

/// What one parameter of the exported function becomes.
#[derive(Clone, Debug)]
pub enum ExportParam {
    /// A graph input of this name.
    Input(String),
    /// An initializer of this name holding this value (a captured weight).
    Initializer(String, DenseHostTensor),
}

/// `function` as an ONNX model: `params` says what each of its parameters
/// becomes (in order), `outputs` names its results (in order).
pub fn export_function(
    function: &Function,
    params: &[ExportParam],
    outputs: &[String],
) -> Result<ModelProto> {
    if params.len() != function.params.len() {
        return Err(OnnxError::invalid(format!(
            "@{} takes {} parameters, {} were described",
            function.name,
            function.params.len(),
            params.len()
        )));
    }
    if outputs.len() != function.results.len() {
        return Err(OnnxError::invalid(format!(
            "@{} returns {} results, {} names were given",
            function.name,
            function.results.len(),
            outputs.len()
        )));
    }
    let mut ex = Exporter::default();
    let mut graph = GraphProto {
        name: Some(function.name.clone()),
        ..Default::default()
    };
    let mut args = Vec::new();
    for (p, meta) in params.iter().zip(&function.params) {
        match p {
            ExportParam::Input(name) => {
                graph.input.push(value_info(name, meta)?);
                args.push(name.clone());
            }
            ExportParam::Initializer(name, value) => {
                if value.metadata() != meta {
                    return Err(OnnxError::invalid(format!(
                        "initializer '{name}' is {}, the parameter is {meta}",
                        value.metadata()
                    )));
                }
                graph.initializer.push(encode(name, value)?);
                args.push(name.clone());
            }
        }
    }
    let results = ex.emit(function, &args, &mut graph)?;
    for ((result, name), value) in results.iter().zip(outputs).zip(&function.results) {
        // Graph outputs are names of their own: an Identity gives each its
        // name even where one value is returned twice or is an input.
        graph
            .node
            .push(ex.node("Identity", &[result.as_str()], &[name], Vec::new()));
        graph.output.push(value_info(name, function.meta(*value))?);
    }
    Ok(ModelProto {
        ir_version: Some(8),
        producer_name: Some("stagecraft".into()),
        producer_version: Some(env!("CARGO_PKG_VERSION").into()),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(EXPORT_OPSET),
        }],
        graph: Some(graph),
        ..Default::default()
    })
}

/// [`export_function`] as the bytes of an `.onnx` file.
pub fn export_to_bytes(
    function: &Function,
    params: &[ExportParam],
    outputs: &[String],
) -> Result<Vec<u8>> {
    Ok(export_function(function, params, outputs)?.encode_to_vec())
}

fn value_info(name: &str, meta: &TensorMetadata) -> Result<ValueInfoProto> {
    Ok(ValueInfoProto {
        name: Some(name.to_string()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(onnx_type_of(meta.dtype)?),
                shape: Some(TensorShapeProto {
                    dim: meta
                        .shape
                        .dims()
                        .iter()
                        .map(|&d| tensor_shape_proto::Dimension {
                            value: Some(tensor_shape_proto::dimension::Value::DimValue(d as i64)),
                            ..Default::default()
                        })
                        .collect(),
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    })
}

fn attr_int(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Int as i32),
        i: Some(v),
        ..Default::default()
    }
}

fn attr_ints(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Ints as i32),
        ints: v.to_vec(),
        ..Default::default()
    }
}

fn attr_float(name: &str, v: f32) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Float as i32),
        f: Some(v),
        ..Default::default()
    }
}

fn attr_string(name: &str, v: &str) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::String as i32),
        s: Some(v.as_bytes().to_vec()),
        ..Default::default()
    }
}

fn attr_graph(name: &str, g: GraphProto) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Graph as i32),
        g: Some(g),
        ..Default::default()
    }
}

/// Fresh value and node names, unique in the whole model (subgraphs see
/// their parents' names).
#[derive(Default)]
struct Exporter {
    counter: usize,
}

/// Where the nodes of the function being emitted go, with the names of its
/// values.
struct Scope<'g> {
    graph: &'g mut GraphProto,
    function: &'g Function,
    names: HashMap<Value, String>,
}

impl Scope<'_> {
    fn dims(&self, value: Value) -> Vec<usize> {
        self.function.meta(value).shape.dims().to_vec()
    }
}

impl Exporter {
    fn fresh(&mut self, hint: &str) -> String {
        self.counter += 1;
        format!("{hint}_{}", self.counter)
    }

    fn node(
        &mut self,
        op: &str,
        inputs: &[&str],
        outputs: &[&str],
        attrs: Vec<AttributeProto>,
    ) -> NodeProto {
        NodeProto {
            op_type: Some(op.into()),
            name: Some(self.fresh(op)),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            attribute: attrs,
            ..Default::default()
        }
    }

    /// Emits `function`'s nodes into `graph` with its parameters bound to
    /// `args`; returns the names of its results.
    fn emit(
        &mut self,
        function: &Function,
        args: &[String],
        graph: &mut GraphProto,
    ) -> Result<Vec<String>> {
        let mut scope = Scope {
            graph,
            function,
            names: args
                .iter()
                .enumerate()
                .map(|(i, a)| (Value::Param(i as u32), a.clone()))
                .collect(),
        };
        for (index, node) in function.nodes.iter().enumerate() {
            let outputs = self.emit_node(node, &mut scope).map_err(|e| {
                let op = node.op.name();
                OnnxError::new(
                    e.kind(),
                    format!(
                        "exporting {op} (created at {}): {}",
                        node.location,
                        e.message()
                    ),
                )
            })?;
            for (i, name) in outputs.into_iter().enumerate() {
                scope.names.insert(
                    Value::Output {
                        node: index as u32,
                        output: i as u32,
                    },
                    name,
                );
            }
        }
        function
            .results
            .iter()
            .map(|v| {
                scope
                    .names
                    .get(v)
                    .cloned()
                    .ok_or_else(|| OnnxError::invalid(format!("{v:?} is never computed")))
            })
            .collect()
    }

    /// Adds `value` as an initializer; returns its name.
    fn constant(&mut self, scope: &mut Scope<'_>, value: &DenseHostTensor) -> Result<String> {
        let name = self.fresh("const");
        scope.graph.initializer.push(encode(&name, value)?);
        Ok(name)
    }

    fn ints_constant(&mut self, scope: &mut Scope<'_>, values: &[i64]) -> Result<String> {
        let t = DenseHostTensor::from_slice(values, [values.len()])?;
        self.constant(scope, &t)
    }

    fn scalar_constant(
        &mut self,
        scope: &mut Scope<'_>,
        value: f64,
        dtype: DType,
    ) -> Result<String> {
        let t = filled(value, TensorMetadata::new(dtype, []))?;
        self.constant(scope, &t)
    }

    /// One op: `inputs` → fresh outputs; returns their names.
    fn op(
        &mut self,
        scope: &mut Scope<'_>,
        op: &str,
        inputs: &[&str],
        outputs: usize,
        attrs: Vec<AttributeProto>,
    ) -> Vec<String> {
        let outs: Vec<String> = (0..outputs).map(|_| self.fresh("v")).collect();
        let out_refs: Vec<&str> = outs.iter().map(String::as_str).collect();
        let node = self.node(op, inputs, &out_refs, attrs);
        scope.graph.node.push(node);
        outs
    }

    fn op1(
        &mut self,
        scope: &mut Scope<'_>,
        op: &str,
        inputs: &[&str],
        attrs: Vec<AttributeProto>,
    ) -> String {
        self.op(scope, op, inputs, 1, attrs).remove(0)
    }

    fn emit_node(&mut self, node: &Node, scope: &mut Scope<'_>) -> Result<Vec<String>> {
        let (def, attrs) = match &node.op {
            NodeOp::Const(value) => {
                let dense = value.to_dense()?;
                return Ok(vec![self.constant(scope, &dense)?]);
            }
            NodeOp::Op(def, attrs) => (*def, attrs),
        };
        let inputs: Vec<String> = node
            .inputs
            .iter()
            .map(|v| match scope.names.get(v) {
                Some(n) if n.starts_with('<') => Err(OnnxError::unsupported(format!(
                    "it reads {} (a statistic for the backward pass)",
                    &n[1..n.len() - 1]
                ))),
                Some(n) => Ok(n.clone()),
                None => Err(OnnxError::invalid(format!("input {v:?} is never computed"))),
            })
            .collect::<Result<_>>()?;
        let a: Vec<&str> = inputs.iter().map(String::as_str).collect();
        let at = Attrs::new(attrs, def);
        let out_meta = &node.outputs;
        let dtype = out_meta.first().map(|m| m.dtype);
        let name = def.name;
        let one = |ex: &mut Exporter, scope: &mut Scope<'_>, op: &str, attrs| {
            Ok(vec![ex.op1(scope, op, &a, attrs)])
        };
        match name {
            "Neg" | "Abs" | "Exp" | "Log" | "Sqrt" | "Tanh" | "Sigmoid" | "Relu" | "Sin"
            | "Cos" | "Sign" | "Floor" | "Ceil" | "Erf" | "Softplus" | "Reciprocal" | "Add"
            | "Sub" | "Mul" | "Div" | "Equal" | "Less" | "Greater" | "Where" => {
                one(self, scope, name, Vec::new())
            }
            "Round" => one(self, scope, "Round", Vec::new()),
            "LogicalNot" => one(self, scope, "Not", Vec::new()),
            "LogicalAnd" => one(self, scope, "And", Vec::new()),
            "LogicalOr" => one(self, scope, "Or", Vec::new()),
            "Maximum" => one(self, scope, "Max", Vec::new()),
            "Minimum" => one(self, scope, "Min", Vec::new()),
            "LessEqual" => one(self, scope, "LessOrEqual", Vec::new()),
            "GreaterEqual" => one(self, scope, "GreaterOrEqual", Vec::new()),
            "Select" => one(self, scope, "Where", Vec::new()),
            "Pow" => one(self, scope, "Pow", Vec::new()),
            "NotEqual" => {
                let eq = self.op1(scope, "Equal", &a, Vec::new());
                Ok(vec![self.op1(scope, "Not", &[&eq], Vec::new())])
            }
            "Square" => Ok(vec![self.op1(scope, "Mul", &[a[0], a[0]], Vec::new())]),
            "Rsqrt" => {
                let s = self.op1(scope, "Sqrt", &a, Vec::new());
                Ok(vec![self.op1(scope, "Reciprocal", &[&s], Vec::new())])
            }
            "Silu" => {
                let s = self.op1(scope, "Sigmoid", &a, Vec::new());
                Ok(vec![self.op1(scope, "Mul", &[a[0], &s], Vec::new())])
            }
            "Log1p" | "Expm1" => {
                let dt = dtype.unwrap_or(DType::F32);
                let one_c = self.scalar_constant(scope, 1.0, dt)?;
                if name == "Log1p" {
                    let s = self.op1(scope, "Add", &[a[0], &one_c], Vec::new());
                    Ok(vec![self.op1(scope, "Log", &[&s], Vec::new())])
                } else {
                    let e = self.op1(scope, "Exp", &a, Vec::new());
                    Ok(vec![self.op1(scope, "Sub", &[&e, &one_c], Vec::new())])
                }
            }
            "Gelu" => {
                // x · Φ(x) = x · (1 + erf(x/√2)) / 2
                let dt = dtype.unwrap_or(DType::F32);
                let inv_sqrt2 = self.scalar_constant(scope, std::f64::consts::FRAC_1_SQRT_2, dt)?;
                let half = self.scalar_constant(scope, 0.5, dt)?;
                let one_c = self.scalar_constant(scope, 1.0, dt)?;
                let s = self.op1(scope, "Mul", &[a[0], &inv_sqrt2], Vec::new());
                let e = self.op1(scope, "Erf", &[&s], Vec::new());
                let p = self.op1(scope, "Add", &[&e, &one_c], Vec::new());
                let h = self.op1(scope, "Mul", &[a[0], &half], Vec::new());
                Ok(vec![self.op1(scope, "Mul", &[&h, &p], Vec::new())])
            }
            "GeluTanh" => {
                // x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))
                let dt = dtype.unwrap_or(DType::F32);
                let c = self.scalar_constant(scope, (2.0 / std::f64::consts::PI).sqrt(), dt)?;
                let k = self.scalar_constant(scope, 0.044715, dt)?;
                let half = self.scalar_constant(scope, 0.5, dt)?;
                let one_c = self.scalar_constant(scope, 1.0, dt)?;
                let x2 = self.op1(scope, "Mul", &[a[0], a[0]], Vec::new());
                let x3 = self.op1(scope, "Mul", &[&x2, a[0]], Vec::new());
                let kx3 = self.op1(scope, "Mul", &[&x3, &k], Vec::new());
                let inner = self.op1(scope, "Add", &[a[0], &kx3], Vec::new());
                let scaled = self.op1(scope, "Mul", &[&inner, &c], Vec::new());
                let t = self.op1(scope, "Tanh", &[&scaled], Vec::new());
                let p = self.op1(scope, "Add", &[&t, &one_c], Vec::new());
                let h = self.op1(scope, "Mul", &[a[0], &half], Vec::new());
                Ok(vec![self.op1(scope, "Mul", &[&h, &p], Vec::new())])
            }
            "Cast" => {
                let to = onnx_type_of(at.dtype("dtype")?)?;
                one(self, scope, "Cast", vec![attr_int("to", to as i64)])
            }
            "Sum" | "Mean" | "Max" | "Min" | "Prod" => {
                let op = match name {
                    "Sum" => "ReduceSum",
                    "Mean" => "ReduceMean",
                    "Max" => "ReduceMax",
                    "Min" => "ReduceMin",
                    _ => "ReduceProd",
                };
                let axes = at.ints("axes")?;
                let keep = attr_int("keepdims", at.bool("keepdim")? as i64);
                if axes.is_empty() {
                    Ok(vec![self.op1(scope, op, &a, vec![keep])])
                } else {
                    let ax = self.ints_constant(scope, axes)?;
                    Ok(vec![self.op1(scope, op, &[a[0], &ax], vec![keep])])
                }
            }
            "ArgMax" | "ArgMin" => one(
                self,
                scope,
                name,
                vec![
                    attr_int("axis", at.int("axis")?),
                    attr_int("keepdims", at.bool("keepdim")? as i64),
                ],
            ),
            "Softmax" | "LogSoftmax" => {
                one(self, scope, name, vec![attr_int("axis", at.int("axis")?)])
            }
            "MatMul" => {
                let (ta, tb) = (at.bool("transpose_a")?, at.bool("transpose_b")?);
                let x = if ta {
                    self.swap_last(scope, a[0], node.inputs[0])
                } else {
                    a[0].to_string()
                };
                let y = if tb {
                    self.swap_last(scope, a[1], node.inputs[1])
                } else {
                    a[1].to_string()
                };
                Ok(vec![self.op1(scope, "MatMul", &[&x, &y], Vec::new())])
            }
            "Reshape" | "BroadcastTo" => {
                let shape = self.ints_constant(scope, at.ints("shape")?)?;
                let op = if name == "Reshape" {
                    "Reshape"
                } else {
                    "Expand"
                };
                Ok(vec![self.op1(scope, op, &[a[0], &shape], Vec::new())])
            }
            "Transpose" => one(
                self,
                scope,
                "Transpose",
                vec![attr_ints("perm", at.ints("perm")?)],
            ),
            "Concat" => one(
                self,
                scope,
                "Concat",
                vec![attr_int("axis", at.int("axis")?)],
            ),
            "Gather" => one(
                self,
                scope,
                "Gather",
                vec![attr_int("axis", at.int("axis")?)],
            ),
            "Embedding" => Ok(vec![self.op1(
                scope,
                "Gather",
                &[a[0], a[1]],
                vec![attr_int("axis", 0)],
            )]),
            "Slice" => {
                let starts = at.ints("starts")?;
                let ends = at.ints("ends")?;
                let steps = at.ints("steps")?;
                let axes: Vec<i64> = (0..starts.len() as i64).collect();
                let s = self.ints_constant(scope, starts)?;
                let e = self.ints_constant(scope, ends)?;
                let ax = self.ints_constant(scope, &axes)?;
                let mut ins = vec![a[0], &s, &e, &ax];
                let st;
                if !steps.is_empty() {
                    st = self.ints_constant(scope, steps)?;
                    ins.push(&st);
                }
                Ok(vec![self.op1(scope, "Slice", &ins, Vec::new())])
            }
            "Pad" => {
                let pads = at.ints("pads")?;
                let rank = pads.len() / 2;
                let onnx_pads: Vec<i64> = (0..rank)
                    .map(|i| pads[2 * i])
                    .chain((0..rank).map(|i| pads[2 * i + 1]))
                    .collect();
                let p = self.ints_constant(scope, &onnx_pads)?;
                let dt = dtype.unwrap_or(DType::F32);
                let v = self.scalar_constant(scope, at.float("value")?, dt)?;
                Ok(vec![self.op1(
                    scope,
                    "Pad",
                    &[a[0], &p, &v],
                    vec![attr_string("mode", "constant")],
                )])
            }
            "Conv2d" => {
                let p = at.ints("padding")?;
                let pads = [p[0], p[1], p[0], p[1]];
                one(
                    self,
                    scope,
                    "Conv",
                    vec![
                        attr_ints("strides", at.ints("stride")?),
                        attr_ints("pads", &pads),
                        attr_ints("dilations", at.ints("dilation")?),
                        attr_int("group", at.int("groups")?),
                    ],
                )
            }
            "MaxPool2d" | "AvgPool2d" => {
                let kernel = at.ints("kernel")?;
                let stride = match at.ints("stride")? {
                    [] => kernel,
                    s => s,
                };
                let p = at.ints("padding")?;
                let mut attrs = vec![
                    attr_ints("kernel_shape", kernel),
                    attr_ints("strides", stride),
                    attr_ints("pads", &[p[0], p[1], p[0], p[1]]),
                ];
                let op = if name == "MaxPool2d" {
                    "MaxPool"
                } else {
                    attrs.push(attr_int(
                        "count_include_pad",
                        at.bool("count_include_pad")? as i64,
                    ));
                    "AveragePool"
                };
                one(self, scope, op, attrs)
            }
            "LayerNorm" => self.layer_norm(scope, node, &at, &a),
            "RmsNorm" => self.rms_norm(scope, node, &at, &a),
            "ScaledDotProductAttention" => self.attention(scope, node, &at, &a),
            "CrossEntropy" => {
                let mut attrs = vec![attr_string("reduction", at.str("reduction")?)];
                if let [ignore] = at.ints("ignore_index")? {
                    attrs.push(attr_int("ignore_index", *ignore));
                }
                let loss = self.op1(scope, "SoftmaxCrossEntropyLoss", &a, attrs);
                Ok(vec![loss, unused("logsumexp")])
            }
            "Cumsum" => {
                let axis = self.ints_constant(scope, &[at.int("axis")?])?;
                let axis = self.op1(scope, "Squeeze", &[&axis], Vec::new());
                Ok(vec![self.op1(
                    scope,
                    "CumSum",
                    &[a[0], &axis],
                    vec![
                        attr_int("exclusive", at.bool("exclusive")? as i64),
                        attr_int("reverse", at.bool("reverse")? as i64),
                    ],
                )])
            }
            "Trilu" => {
                let k = DenseHostTensor::from_slice(&[at.int("k")?], [])?;
                let k = self.constant(scope, &k)?;
                Ok(vec![self.op1(
                    scope,
                    "Trilu",
                    &[a[0], &k],
                    vec![attr_int("upper", at.bool("upper")? as i64)],
                )])
            }
            "Call" => {
                let callee = stagecraft_graph::Function::lookup(at.func("f")?)
                    .ok_or_else(|| OnnxError::invalid("the callee is not registered"))?;
                self.emit(&callee, &inputs, scope.graph)
            }
            "If" => self.if_node(scope, node, &at, &inputs),
            "While" => self.while_node(scope, node, &at, &inputs),
            _ if node.inputs.is_empty() && def.effect == stagecraft_ops::Effect::Pure => {
                self.evaluate(scope, def, attrs)
            }
            _ => Err(OnnxError::unsupported(format!(
                "{name} has no ONNX equivalent the exporter writes"
            ))),
        }
    }

    /// `x` (the value `value`, of rank ≥ 2: the matmul checked it) with its
    /// last two axes swapped.
    fn swap_last(&mut self, scope: &mut Scope<'_>, x: &str, value: Value) -> String {
        let rank = scope.dims(value).len();
        let mut perm: Vec<i64> = (0..rank as i64).collect();
        perm.swap(rank - 2, rank - 1);
        self.op1(scope, "Transpose", &[x], vec![attr_ints("perm", &perm)])
    }

    fn evaluate(
        &mut self,
        scope: &mut Scope<'_>,
        def: &'static OpDef,
        attrs: &FrozenOpAttrs,
    ) -> Result<Vec<String>> {
        let cpu = Device::cpu();
        let outs = execute(
            def,
            cpu,
            stagecraft_tensor::Location::caller(),
            Default::default(),
            (&**attrs).into(),
        );
        outs.iter()
            .map(|h| {
                let v = h.wait()?.to_dense()?;
                self.constant(scope, &v)
            })
            .collect()
    }

    fn layer_norm(
        &mut self,
        scope: &mut Scope<'_>,
        node: &Node,
        at: &Attrs<'_>,
        a: &[&str],
    ) -> Result<Vec<String>> {
        let x_meta = &node.outputs[0];
        let d = *x_meta.shape.dims().last().unwrap_or(&1);
        let mut next = 1;
        let scale = if at.bool("has_weight")? {
            next += 1;
            a[1].to_string()
        } else {
            let ones = filled(1.0, TensorMetadata::new(x_meta.dtype, [d]))?;
            self.constant(scope, &ones)?
        };
        let mut ins = vec![a[0].to_string(), scale];
        if at.bool("has_bias")? {
            ins.push(a[next].to_string());
        }
        let refs: Vec<&str> = ins.iter().map(String::as_str).collect();
        let y = self.op1(
            scope,
            "LayerNormalization",
            &refs,
            vec![
                attr_int("axis", -1),
                attr_float("epsilon", at.float("eps")? as f32),
            ],
        );
        // The statistics are for the backward pass: a forward function
        // that returns them has no ONNX reading of their shapes.
        Ok(vec![y.clone(), unused("mean"), unused("rstd")])
    }

    fn rms_norm(
        &mut self,
        scope: &mut Scope<'_>,
        node: &Node,
        at: &Attrs<'_>,
        a: &[&str],
    ) -> Result<Vec<String>> {
        let dt = node.outputs[0].dtype;
        let sq = self.op1(scope, "Mul", &[a[0], a[0]], Vec::new());
        let axes = self.ints_constant(scope, &[-1])?;
        let ms = self.op1(
            scope,
            "ReduceMean",
            &[&sq, &axes],
            vec![attr_int("keepdims", 1)],
        );
        let eps = self.scalar_constant(scope, at.float("eps")?, dt)?;
        let v = self.op1(scope, "Add", &[&ms, &eps], Vec::new());
        let s = self.op1(scope, "Sqrt", &[&v], Vec::new());
        let r = self.op1(scope, "Reciprocal", &[&s], Vec::new());
        let mut y = self.op1(scope, "Mul", &[a[0], &r], Vec::new());
        if at.bool("has_weight")? {
            y = self.op1(scope, "Mul", &[&y, a[1]], Vec::new());
        }
        Ok(vec![y, unused("rstd")])
    }

    fn attention(
        &mut self,
        scope: &mut Scope<'_>,
        node: &Node,
        at: &Attrs<'_>,
        a: &[&str],
    ) -> Result<Vec<String>> {
        // The op's shape rule checked q and k: one rank, 3 or 4 (4 with
        // the "bthd" layout, whose operands are transposed to "bhtd" here
        // and the output back).
        let q_dims = scope.dims(node.inputs[0]);
        let k_dims = scope.dims(node.inputs[1]);
        let rank = q_dims.len();
        let sequence_first = at.str("layout")? == stagecraft_ops::SEQUENCE_FIRST;
        let (t, s, dh) = if sequence_first {
            (q_dims[1], k_dims[1], q_dims[3])
        } else {
            (q_dims[rank - 2], k_dims[rank - 2], q_dims[rank - 1])
        };
        let swap = vec![attr_ints("perm", &[0, 2, 1, 3])];
        let swapped: Vec<String> = if sequence_first {
            a.iter()
                .map(|x| self.op1(scope, "Transpose", &[x], swap.clone()))
                .collect()
        } else {
            a.iter().map(|x| x.to_string()).collect()
        };
        let a: Vec<&str> = swapped.iter().map(String::as_str).collect();
        let dt = node.outputs[0].dtype;
        let scale = match at.float("scale")? {
            v if v.is_nan() => 1.0 / (dh as f64).sqrt(),
            v => v,
        };
        let mut perm: Vec<i64> = (0..rank as i64).collect();
        perm.swap(rank - 2, rank - 1);
        let kt = self.op1(scope, "Transpose", &[a[1]], vec![attr_ints("perm", &perm)]);
        let scores = self.op1(scope, "MatMul", &[a[0], &kt], Vec::new());
        let sc = self.scalar_constant(scope, scale, dt)?;
        let mut scores = self.op1(scope, "Mul", &[&scores, &sc], Vec::new());
        if at.bool("causal")? {
            // Query i sees keys j ≤ i, counted from the first query and
            // key (the op's upper-left alignment).
            let mask: Vec<f64> = (0..t as i64)
                .flat_map(|i| {
                    (0..s as i64).map(move |j| if j <= i { 0.0 } else { f64::NEG_INFINITY })
                })
                .collect();
            let mask = DenseHostTensor::from_slice(&mask, [t, s])?;
            let m = self.constant(scope, &mask)?;
            let m = self.op1(
                scope,
                "Cast",
                &[&m],
                vec![attr_int("to", onnx_type_of(dt)? as i64)],
            );
            scores = self.op1(scope, "Add", &[&scores, &m], Vec::new());
        }
        let p = self.op1(scope, "Softmax", &[&scores], vec![attr_int("axis", -1)]);
        let mut o = self.op1(scope, "MatMul", &[&p, a[2]], Vec::new());
        if sequence_first {
            o = self.op1(scope, "Transpose", &[&o], swap);
        }
        Ok(vec![o, unused("logsumexp")])
    }

    fn if_node(
        &mut self,
        scope: &mut Scope<'_>,
        node: &Node,
        at: &Attrs<'_>,
        inputs: &[String],
    ) -> Result<Vec<String>> {
        let mut branches = Vec::new();
        for attr in ["then_branch", "else_branch"] {
            let f = Function::lookup(at.func(attr)?)
                .ok_or_else(|| OnnxError::invalid(format!("{attr} is not registered")))?;
            let mut g = GraphProto {
                name: Some(self.fresh(attr)),
                ..Default::default()
            };
            let results = self.emit(&f, &inputs[1..], &mut g)?;
            for (r, v) in results.iter().zip(&f.results) {
                let out = self.fresh("branch_out");
                g.node
                    .push(self.node("Identity", &[r], &[&out], Vec::new()));
                g.output.push(value_info(&out, f.meta(*v))?);
            }
            branches.push(g);
        }
        let else_g = branches.pop().expect("two branches");
        let then_g = branches.pop().expect("two branches");
        Ok(self.op(
            scope,
            "If",
            &[&inputs[0]],
            node.outputs.len(),
            vec![
                attr_graph("then_branch", then_g),
                attr_graph("else_branch", else_g),
            ],
        ))
    }

    /// `While(cond, body)(state)` as `Loop(M = "", c = cond(state), state)`
    /// whose body runs `body` and computes the next condition.
    fn while_node(
        &mut self,
        scope: &mut Scope<'_>,
        node: &Node,
        at: &Attrs<'_>,
        inputs: &[String],
    ) -> Result<Vec<String>> {
        let cond = Function::lookup(at.func("cond")?)
            .ok_or_else(|| OnnxError::invalid("cond is not registered"))?;
        let body = Function::lookup(at.func("body")?)
            .ok_or_else(|| OnnxError::invalid("body is not registered"))?;
        let max = at.int("max_iterations")?;
        let first = self.emit(&cond, inputs, scope.graph)?;
        let mut g = GraphProto {
            name: Some(self.fresh("loop_body")),
            ..Default::default()
        };
        let iter = self.fresh("iter");
        let cond_in = self.fresh("cond_in");
        let i64_scalar = TensorMetadata::new(DType::I64, []);
        let bool_scalar = TensorMetadata::new(DType::Bool, []);
        g.input.push(value_info(&iter, &i64_scalar)?);
        g.input.push(value_info(&cond_in, &bool_scalar)?);
        let mut state = Vec::new();
        for meta in &body.params {
            let s = self.fresh("state_in");
            g.input.push(value_info(&s, meta)?);
            state.push(s);
        }
        let next = self.emit(&body, &state, &mut g)?;
        let next_cond = self.emit(&cond, &next, &mut g)?;
        let cond_out = self.fresh("cond_out");
        g.node
            .push(self.node("Identity", &[&next_cond[0]], &[&cond_out], Vec::new()));
        g.output.push(value_info(&cond_out, &bool_scalar)?);
        for (n, meta) in next.iter().zip(&body.params) {
            let out = self.fresh("state_out");
            g.node
                .push(self.node("Identity", &[n], &[&out], Vec::new()));
            g.output.push(value_info(&out, meta)?);
        }
        let trip = if max >= 0 {
            let t = DenseHostTensor::from_slice(&[max], [])?;
            self.constant(scope, &t)?
        } else {
            String::new()
        };
        let mut ins: Vec<&str> = vec![&trip, &first[0]];
        ins.extend(inputs.iter().map(String::as_str));
        Ok(self.op(
            scope,
            "Loop",
            &ins,
            node.outputs.len(),
            vec![attr_graph("body", g)],
        ))
    }
}

/// The name of an output the export does not compute (the statistics a
/// backward pass reads); a node that reads one is an export error.
fn unused(what: &str) -> String {
    format!("<{what}>")
}

/// A dense tensor of `meta` whose elements all equal `value`.
fn filled(value: f64, meta: TensorMetadata) -> Result<DenseHostTensor> {
    Ok(stagecraft_tensor::HostTensor::filled(Scalar::F64(value), &meta).to_dense()?)
}
