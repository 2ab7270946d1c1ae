//! A loaded ONNX model: its inputs and outputs, and running it eagerly, on
//! the lazy device or as a staged graph function.

use crate::error::{OnnxError, OnnxErrorKind, Result};
use crate::proto::{tensor_shape_proto, type_proto, GraphProto, ModelProto, ValueInfoProto};
use crate::tensor::{decode, dtype_of};
use crate::translate::{self, Val};
use prost::Message;
use stagecraft_ops::{FuncId, OpAttrs};
use stagecraft_runtime::{execute, tracing, Device, TensorHandle};
use stagecraft_tensor::{DType, DenseHostTensor, HostTensor, Location, TensorMetadata};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;

/// The newest version of the default (`ai.onnx`) opset the importer knows
/// (that of onnx 1.22.0).
/// Models importing a newer one are refused as unsupported.
pub const MAX_OPSET: i64 = 27;

/// One dimension of a declared input or output shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    /// A fixed size.
    Fixed(usize),
    /// A symbolic size (`batch`), resolved per call.
    Named(String),
    /// A size the model leaves open.
    Unknown,
}

/// A declared graph input or output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValueInfo {
    /// Its name.
    pub name: String,
    /// Its dtype, if the model declares a supported one.
    pub dtype: Option<DType>,
    /// Its shape, if declared.
    pub shape: Option<Vec<Dim>>,
    /// Its declared type as ONNX names it (`tensor(float)`, `tensor(uint16)`,
    /// `sequence`, `optional`, `map`), for messages.
    pub onnx_type: String,
}

/// How [`Model::run_with`] runs a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Op by op on the CPU.
    Eager,
    /// Recorded on the lazy device and run as one compiled trace.
    Lazy,
    /// Traced once per input signature into a graph `Function` (so the
    /// passes, fusion and the executor apply) and run with `Call`.
    Function,
}

/// A value a model can take as an input.
pub trait ModelInput {
    /// The value on the host.
    fn to_host(&self) -> Result<DenseHostTensor>;
}

impl ModelInput for DenseHostTensor {
    fn to_host(&self) -> Result<DenseHostTensor> {
        Ok(self.clone())
    }
}

impl ModelInput for HostTensor {
    fn to_host(&self) -> Result<DenseHostTensor> {
        Ok(self.to_dense()?)
    }
}

impl ModelInput for TensorHandle {
    fn to_host(&self) -> Result<DenseHostTensor> {
        Ok(self.wait()?.to_dense()?)
    }
}

/// An ONNX model ready to run.
pub struct Model {
    graph: GraphProto,
    opset: i64,
    initializers: HashMap<String, DenseHostTensor>,
    inputs: Vec<ValueInfo>,
    outputs: Vec<ValueInfo>,
    /// Values some node needs known (the graph inputs among them are baked
    /// in per call).
    statics: HashSet<String>,
    functions: Mutex<HashMap<Signature, FuncId>>,
    /// The model without its graph (IR version, opset imports, producer),
    /// kept to write the model back with new initializer values.
    header: ModelProto,
}

/// What a traced function is specialized on: the inputs' metadata, the
/// values of the inputs baked in as constants (see [`baked`]), and the
/// initializers taken as parameters instead of constants.
type Signature = (Vec<TensorMetadata>, Vec<Option<Vec<u8>>>, Vec<String>);

/// The inputs baked in as constants: those whose values some node needs
/// when it is translated (see [`Model::from_proto`]).
fn baked(
    infos: &[ValueInfo],
    values: &[DenseHostTensor],
    statics: &HashSet<String>,
) -> Vec<Option<DenseHostTensor>> {
    infos
        .iter()
        .zip(values)
        .map(|(info, v)| statics.contains(&info.name).then(|| v.clone()))
        .collect()
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("opset", &self.opset)
            .field("inputs", &self.inputs)
            .field("outputs", &self.outputs)
            .field("nodes", &self.graph.node.len())
            .finish()
    }
}

fn value_info(v: &ValueInfoProto) -> ValueInfo {
    let tensor = v.r#type.as_ref().and_then(|t| match &t.value {
        Some(type_proto::Value::TensorType(t)) => Some(t),
        _ => None,
    });
    let onnx_type = match v.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => {
            let name = crate::proto::tensor_proto::DataType::try_from(t.elem_type())
                .map_or("unknown", |d| d.as_str_name());
            format!("tensor({})", name.to_lowercase())
        }
        Some(type_proto::Value::SequenceType(_)) => "sequence".to_string(),
        Some(type_proto::Value::MapType(_)) => "map".to_string(),
        Some(type_proto::Value::OptionalType(_)) => "optional".to_string(),
        Some(type_proto::Value::SparseTensorType(_)) => "sparse tensor".to_string(),
        None => "undeclared".to_string(),
    };
    ValueInfo {
        onnx_type,
        name: v.name().to_string(),
        dtype: tensor.and_then(|t| dtype_of(t.elem_type()).ok()),
        shape: tensor.and_then(|t| t.shape.as_ref()).map(|s| {
            s.dim
                .iter()
                .map(|d| match &d.value {
                    Some(tensor_shape_proto::dimension::Value::DimValue(v)) if *v >= 0 => {
                        Dim::Fixed(*v as usize)
                    }
                    Some(tensor_shape_proto::dimension::Value::DimParam(p)) => {
                        Dim::Named(p.clone())
                    }
                    _ => Dim::Unknown,
                })
                .collect()
        }),
    }
}

impl Model {
    /// Reads and decodes the model in `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<Model> {
        let path = path.as_ref();
        let bytes = std::fs::read(path)
            .map_err(|e| OnnxError::io(format!("cannot read {}: {e}", path.display())))?;
        Model::from_bytes(&bytes).map_err(|e| {
            if e.kind() == OnnxErrorKind::Decode {
                OnnxError::new(
                    OnnxErrorKind::Decode,
                    format!("{}: {}", path.display(), e.message()),
                )
            } else {
                e
            }
        })
    }

    /// Decodes a model from the bytes of an `.onnx` file.
    pub fn from_bytes(bytes: &[u8]) -> Result<Model> {
        let proto = ModelProto::decode(bytes).map_err(|e| {
            OnnxError::new(
                OnnxErrorKind::Decode,
                format!("not a valid ONNX model (truncated or corrupt?): {e}"),
            )
        })?;
        Model::from_proto(proto)
    }

    /// A model from its decoded protobuf.
    pub fn from_proto(mut proto: ModelProto) -> Result<Model> {
        let graph = proto
            .graph
            .take()
            .ok_or_else(|| OnnxError::new(OnnxErrorKind::Decode, "the model has no graph"))?;
        let opset = proto
            .opset_import
            .iter()
            .find(|o| matches!(o.domain(), "" | "ai.onnx"))
            .map(|o| o.version())
            .ok_or_else(|| {
                let domains: Vec<&str> = proto.opset_import.iter().map(|o| o.domain()).collect();
                OnnxError::unsupported(format!(
                    "the model imports only the domains {domains:?}, not ai.onnx"
                ))
            })?;
        if opset > MAX_OPSET {
            return Err(OnnxError::unsupported(format!(
                "opset {opset} (the importer knows opsets up to {MAX_OPSET})"
            )));
        }
        let initializers = graph
            .initializer
            .iter()
            .map(|t| {
                decode(t).map(|v| (t.name().to_string(), v)).map_err(|e| {
                    OnnxError::new(
                        e.kind(),
                        format!("initializer '{}': {}", t.name(), e.message()),
                    )
                })
            })
            .collect::<Result<HashMap<_, _>>>()?;
        let inputs = graph
            .input
            .iter()
            .filter(|v| !initializers.contains_key(v.name()))
            .map(value_info)
            .collect();
        let outputs = graph.output.iter().map(value_info).collect();
        // Values some node needs known while translating (shapes, axes,
        // pads, scales, counts), and everything they are computed from,
        // except through `Shape` and `Size`, which read metadata only. The
        // graph inputs among them are baked in per call (the function cache
        // keys on their values); nodes are in topological order, so one
        // pass backwards finds them all.
        let mut statics: HashSet<String> = graph
            .node
            .iter()
            .flat_map(|n| {
                translate::static_inputs(n.op_type())
                    .iter()
                    .filter_map(|&i| n.input.get(i).filter(|s| !s.is_empty()).cloned())
            })
            .collect();
        for n in graph.node.iter().rev() {
            if matches!(n.op_type(), "Shape" | "Size") {
                continue;
            }
            if n.output.iter().any(|o| statics.contains(o)) {
                statics.extend(n.input.iter().filter(|i| !i.is_empty()).cloned());
            }
        }
        Ok(Model {
            statics,
            graph,
            opset,
            initializers,
            inputs,
            outputs,
            functions: Mutex::new(HashMap::new()),
            header: proto,
        })
    }

    /// The initializers a caller can train: the floating-point ones that no
    /// node needs known while translating (a shape, axes or scales tensor
    /// stays a constant), sorted by name.
    pub fn trainable_initializers(&self) -> Vec<(String, DenseHostTensor)> {
        let mut v: Vec<(String, DenseHostTensor)> = self
            .initializers
            .iter()
            .filter(|(name, t)| t.dtype().is_float() && !self.statics.contains(*name))
            .map(|(name, t)| (name.clone(), t.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// The model as a protobuf, with the initializers named in `replace`
    /// holding the given values instead of their own (fine-tuned weights
    /// written back). A name that is not an initializer, or a value of
    /// another dtype or shape, is an error.
    pub fn to_proto_with(&self, replace: &[(String, DenseHostTensor)]) -> Result<ModelProto> {
        let mut graph = self.graph.clone();
        for (name, value) in replace {
            let old = self.initializers.get(name).ok_or_else(|| {
                OnnxError::invalid(format!("the model has no initializer '{name}'"))
            })?;
            if old.metadata() != value.metadata() {
                return Err(OnnxError::invalid(format!(
                    "initializer '{name}' is {} {}, the new value {} {}",
                    old.dtype(),
                    old.shape(),
                    value.dtype(),
                    value.shape()
                )));
            }
            let slot = graph
                .initializer
                .iter_mut()
                .find(|t| t.name() == name)
                .expect("every decoded initializer comes from the graph");
            *slot = crate::tensor::encode(name, value)?;
        }
        let mut proto = self.header.clone();
        proto.graph = Some(graph);
        Ok(proto)
    }

    /// [`Model::to_proto_with`] as the bytes of an `.onnx` file.
    pub fn to_bytes_with(&self, replace: &[(String, DenseHostTensor)]) -> Result<Vec<u8>> {
        Ok(self.to_proto_with(replace)?.encode_to_vec())
    }

    /// The version of the default opset the model imports.
    pub fn opset(&self) -> i64 {
        self.opset
    }

    /// The inputs a caller passes (graph inputs that are not initializers).
    pub fn inputs(&self) -> &[ValueInfo] {
        &self.inputs
    }

    /// The outputs, in the order [`Model::run`] returns them.
    pub fn outputs(&self) -> &[ValueInfo] {
        &self.outputs
    }

    /// How many nodes of each op type the graph has, sorted by op type.
    pub fn op_counts(&self) -> Vec<(String, usize)> {
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for n in &self.graph.node {
            *counts.entry(n.op_type()).or_default() += 1;
        }
        let mut v: Vec<(String, usize)> = counts
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        v.sort();
        v
    }

    /// The op types the importer cannot translate (checked before anything
    /// runs), sorted.
    pub fn unsupported_ops(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .graph
            .node
            .iter()
            .filter(|n| {
                !translate::in_domain(n.domain(), n.op_type())
                    || !translate::is_supported(n.op_type())
            })
            .map(|n| n.op_type().to_string())
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        v.sort();
        v
    }

    /// Runs the model as a staged graph function ([`Mode::Function`]) and
    /// returns its outputs in the order of [`Model::outputs`].
    pub fn run<I: ModelInput>(&self, inputs: &[(&str, I)]) -> Result<Vec<DenseHostTensor>> {
        self.run_with(inputs, Mode::Function)
    }

    /// Runs the model in `mode`.
    pub fn run_with<I: ModelInput>(
        &self,
        inputs: &[(&str, I)],
        mode: Mode,
    ) -> Result<Vec<DenseHostTensor>> {
        let values = self.check_inputs(inputs)?;
        let baked = baked(&self.inputs, &values, &self.statics);
        let cpu = Device::cpu();
        let handles = match mode {
            Mode::Eager => self.translate(cpu, &values, &baked)?,
            Mode::Lazy => self.translate(Device::lazy(&cpu), &values, &baked)?,
            Mode::Function => {
                let metas: Vec<TensorMetadata> =
                    values.iter().map(|v| v.metadata().clone()).collect();
                let id = self.function_for(&metas, &baked)?;
                let mut attrs = OpAttrs::new();
                attrs.set_func("f", id);
                let args = values
                    .iter()
                    .map(|v| TensorHandle::available(cpu, v.clone().into()))
                    .collect();
                execute(
                    &stagecraft_ops::CALL,
                    cpu,
                    Location::caller(),
                    args,
                    (&attrs).into(),
                )
                .into_iter()
                .collect()
            }
        };
        handles
            .iter()
            .map(|h| {
                h.wait()
                    .and_then(|v| v.to_dense())
                    .map_err(|e| OnnxError::new(OnnxErrorKind::Runtime, e.to_string()))
            })
            .collect()
    }

    /// The graph function for inputs of `metas` (in the order of
    /// [`Model::inputs`]) with the given inputs baked in as constants
    /// (their parameters stay, unused), traced on first use and cached per
    /// signature.
    pub fn function_for(
        &self,
        metas: &[TensorMetadata],
        baked: &[Option<DenseHostTensor>],
    ) -> Result<FuncId> {
        self.function_with_params(metas, baked, &[])
    }

    /// [`Model::function_for`] with the initializers named in `params`
    /// taken as parameters after the inputs, in that order, instead of
    /// constants: the function a caller differentiates with respect to the
    /// model's weights (see [`Model::trainable_initializers`]).
    pub fn function_with_params(
        &self,
        metas: &[TensorMetadata],
        baked: &[Option<DenseHostTensor>],
        params: &[String],
    ) -> Result<FuncId> {
        let key: Signature = (
            metas.to_vec(),
            baked
                .iter()
                .map(|b| b.as_ref().map(|t| t.buffer().bytes().to_vec()))
                .collect(),
            params.to_vec(),
        );
        if let Some(id) = self
            .functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(*id);
        }
        let mut all_metas = metas.to_vec();
        for name in params {
            let t = self
                .initializers
                .get(name)
                .filter(|t| t.dtype().is_float() && !self.statics.contains(name))
                .ok_or_else(|| {
                    OnnxError::invalid(format!(
                        "'{name}' is not a trainable initializer of the model"
                    ))
                })?;
            all_metas.push(t.metadata().clone());
        }
        let mut handles = tracing::begin("onnx", &all_metas);
        let param_handles = handles.split_off(metas.len());
        let replaced = params.iter().cloned().zip(param_handles).collect();
        let result = self.translate_handles(tracing::tracer_device(), handles, baked, replaced);
        let results = match result {
            Ok(r) => r,
            Err(e) => {
                tracing::abandon();
                return Err(e);
            }
        };
        let traced = tracing::end(&results, Location::caller())?;
        if !traced.captures.is_empty() {
            return Err(OnnxError::new(
                OnnxErrorKind::Runtime,
                "the traced model captured outside tensors",
            ));
        }
        let id = traced.function.register();
        self.functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, id);
        Ok(id)
    }

    /// Checks the caller's inputs against the declared ones and returns
    /// them in declaration order.
    fn check_inputs<I: ModelInput>(&self, given: &[(&str, I)]) -> Result<Vec<DenseHostTensor>> {
        let names: Vec<&str> = given.iter().map(|(n, _)| *n).collect();
        let order = self.order_inputs(&names)?;
        order
            .into_iter()
            .zip(&self.inputs)
            .map(|(i, info)| {
                let value = given[i].1.to_host()?;
                self.check_input(info, value.metadata())?;
                Ok(value)
            })
            .collect()
    }

    /// For each declared input (in the order of [`Model::inputs`]), the
    /// position of the caller's value among `given`, with each value's
    /// dtype and shape checked against the declaration.
    pub fn match_inputs(&self, given: &[(&str, &TensorMetadata)]) -> Result<Vec<usize>> {
        let names: Vec<&str> = given.iter().map(|(n, _)| *n).collect();
        let order = self.order_inputs(&names)?;
        for (&i, info) in order.iter().zip(&self.inputs) {
            self.check_input(info, given[i].1)?;
        }
        Ok(order)
    }

    /// Whether the value of input `name` is baked into the traced function
    /// (some node needs it known: a shape, axes, a count), so the function
    /// is specialized on it.
    pub fn input_is_baked(&self, name: &str) -> bool {
        self.statics.contains(name)
    }

    fn order_inputs(&self, given: &[&str]) -> Result<Vec<usize>> {
        for name in given {
            if !self.inputs.iter().any(|i| i.name == *name) {
                let names: Vec<&str> = self.inputs.iter().map(|i| i.name.as_str()).collect();
                return Err(OnnxError::invalid(format!(
                    "the model has no input '{name}' (its inputs: {names:?})"
                )));
            }
        }
        self.inputs
            .iter()
            .map(|info| {
                given
                    .iter()
                    .position(|n| *n == info.name)
                    .ok_or_else(|| OnnxError::invalid(format!("missing input '{}'", info.name)))
            })
            .collect()
    }

    fn check_input(&self, info: &ValueInfo, value: &TensorMetadata) -> Result<()> {
        if let Some(dt) = info.dtype {
            if value.dtype != dt {
                return Err(OnnxError::invalid(format!(
                    "input '{}' is {}, the model expects {dt}",
                    info.name, value.dtype
                )));
            }
        }
        if let Some(shape) = &info.shape {
            let d = value.shape.dims();
            let ok = d.len() == shape.len()
                && d.iter().zip(shape).all(|(&n, s)| match s {
                    Dim::Fixed(f) => *f == n,
                    _ => true,
                });
            if !ok {
                return Err(OnnxError::invalid(format!(
                    "input '{}' has shape {}, the model expects {}",
                    info.name,
                    value.shape,
                    describe_dims(shape)
                )));
            }
        }
        Ok(())
    }

    fn translate(
        &self,
        device: Device,
        inputs: &[DenseHostTensor],
        baked: &[Option<DenseHostTensor>],
    ) -> Result<Vec<TensorHandle>> {
        let handles = inputs
            .iter()
            .map(|v| TensorHandle::available(device, v.clone().into()))
            .collect();
        self.translate_handles(device, handles, baked, Vec::new())
    }

    /// Translates the graph on `device` with `inputs` (in the order of
    /// [`Model::inputs`]) and the initializers in `params` replaced by the
    /// given handles, and returns the output handles.
    fn translate_handles(
        &self,
        device: Device,
        inputs: Vec<TensorHandle>,
        baked: &[Option<DenseHostTensor>],
        params: Vec<(String, TensorHandle)>,
    ) -> Result<Vec<TensorHandle>> {
        let mut values: HashMap<String, Val> = HashMap::new();
        for (name, t) in &self.initializers {
            values.insert(
                name.clone(),
                Val {
                    handle: TensorHandle::available(device, t.clone().into()),
                    known: Some(t.clone()),
                },
            );
        }
        for (name, handle) in params {
            values.insert(
                name,
                Val {
                    handle,
                    known: None,
                },
            );
        }
        for ((info, h), b) in self.inputs.iter().zip(inputs).zip(baked) {
            let val = match b {
                Some(t) => Val {
                    handle: TensorHandle::available(device, t.clone().into()),
                    known: Some(t.clone()),
                },
                None => Val {
                    handle: h,
                    known: None,
                },
            };
            values.insert(info.name.clone(), val);
        }
        translate::run_nodes(&self.graph.node, self.opset, device, &mut values)?;
        self.outputs
            .iter()
            .map(|o| {
                values
                    .get(&o.name)
                    .map(|v| v.handle.clone())
                    .ok_or_else(|| {
                        OnnxError::invalid(format!("output '{}' is never computed", o.name))
                    })
            })
            .collect()
    }
}

/// A declared shape as text: `[batch, 3, 224, 224]`, `?` for an open size.
pub fn describe_dims(shape: &[Dim]) -> String {
    let parts: Vec<String> = shape
        .iter()
        .map(|d| match d {
            Dim::Fixed(n) => n.to_string(),
            Dim::Named(s) => s.clone(),
            Dim::Unknown => "?".to_string(),
        })
        .collect();
    format!("[{}]", parts.join(", "))
}
