//! Translating an ONNX graph into stagecraft ops, node by node.
//!
//! The translator emits every op through `stagecraft_runtime::execute` on
//! one device: the CPU (eager), the lazy device (recorded, run as one
//! trace) or the tracer device (recorded into a graph `Function`). One
//! translation therefore serves all three modes.
//!
//! Values whose contents are known before the model runs (initializers,
//! `Constant`s, `Shape`s of inputs of known shape, and every node whose
//! inputs are all known) are computed on the CPU while translating: ONNX
//! passes shapes, axes and pads as tensors, and stagecraft takes them as
//! attributes, so they must be concrete when a node is translated. Dynamic
//! dimensions are therefore resolved per input signature.
//!
//! Each ONNX op is a small function in a family file (`elementwise.rs`,
//! `nn.rs`, `shape.rs`, `reduce.rs`, `recurrent.rs`, `signal.rs`,
//! `vision.rs`, `data.rs`, ...) that reads the node's opset version and
//! attributes; [`lookup`] is the table from op type to function.
//!
//! Ops whose output shape depends on input values (`NonZero`, `Unique`,
//! `Compress`, `NonMaxSuppression`, ...) need those values known before
//! the model runs: they are listed in [`static_inputs`], so a graph input
//! feeding one is baked per call, and a value computed inside the model
//! is refused as unsupported with a message saying so.

mod attention;
mod control;
mod data;
mod elementwise;
mod flex;
mod nn;
mod norm;
mod quantize;
mod recurrent;
mod reduce;
mod resize;
mod shape;
mod signal;
mod vision;

use crate::error::{NodeRef, OnnxError, OnnxErrorKind, Result};
use crate::proto::attribute_proto::AttributeType;
use crate::proto::{AttributeProto, NodeProto};
use stagecraft_ops::{OpAttrs, OpDef};
use stagecraft_runtime::{execute, Args, Device, TensorHandle};
use stagecraft_tensor::{
    DType, DenseHostTensor, HostTensor, Location, Scalar, Shape, TensorMetadata,
};
use std::cell::RefCell;
use std::collections::HashMap;

/// A value of the graph: its handle on the translation's device, and its
/// contents when known before the model runs.
#[derive(Clone)]
pub(crate) struct Val {
    pub handle: TensorHandle,
    pub known: Option<DenseHostTensor>,
}

/// The translation function of one op type.
pub(crate) type Translate = fn(&Ctx<'_>) -> Result<Vec<TensorHandle>>;

/// The translation of `op_type` in the default domain, if supported.
pub(crate) fn lookup(op_type: &str) -> Option<Translate> {
    elementwise::lookup(op_type)
        .or_else(|| nn::lookup(op_type))
        .or_else(|| reduce::lookup(op_type))
        .or_else(|| shape::lookup(op_type))
        .or_else(|| resize::lookup(op_type))
        .or_else(|| attention::lookup(op_type))
        .or_else(|| quantize::lookup(op_type))
        .or_else(|| recurrent::lookup(op_type))
        .or_else(|| signal::lookup(op_type))
        .or_else(|| flex::lookup(op_type))
        .or_else(|| data::lookup(op_type))
        .or_else(|| norm::lookup(op_type))
        .or_else(|| vision::lookup(op_type))
}

/// Whether ops of `domain` named `op_type` are translated: the default
/// domain, and the preview ops that have a translation.
pub(crate) fn in_domain(domain: &str, op_type: &str) -> bool {
    match domain {
        "" | "ai.onnx" => true,
        "ai.onnx.preview" => op_type == "FlexAttention",
        _ => false,
    }
}

/// Whether `op_type` (default domain) has a translation.
pub(crate) fn is_supported(op_type: &str) -> bool {
    lookup(op_type).is_some() || control::is_control(op_type)
}

/// The inputs of `op_type` whose values must be known when a node is
/// translated (shapes, axes, pads, scales, counts): a graph input feeding
/// one is baked in per call.
pub(crate) fn static_inputs(op_type: &str) -> &'static [usize] {
    match op_type {
        "Reshape" | "Expand" | "Tile" | "Squeeze" | "Unsqueeze" | "Split" | "TopK" | "Trilu"
        | "CumSum" | "CumProd" | "OneHot" | "CenterCropPad" => &[1],
        "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceProd" | "ReduceL1"
        | "ReduceL2" | "ReduceSumSquare" | "ReduceLogSum" | "ReduceLogSumExp" => &[1],
        "Slice" => &[1, 2, 3, 4],
        "Col2Im" => &[1, 2],
        "Pad" => &[1, 2, 3],
        "Range" => &[0, 1, 2],
        "Resize" => &[1, 2, 3],
        "Upsample" => &[1],
        "Dropout" => &[1, 2],
        "ConstantOfShape" => &[0],
        "Attention" => &[6],
        "RNN" | "GRU" | "LSTM" => &[4],
        "Compress" | "ReverseSequence" => &[1],
        "NonZero" | "Unique" => &[0],
        "NonMaxSuppression" => &[0, 1, 2, 3, 4],
        "AffineGrid" => &[1],
        "MaxUnpool" => &[2],
        "RoiAlign" => &[1, 2],
        "TensorScatter" => &[2],
        "DFT" => &[1, 2],
        "STFT" => &[1, 3],
        "HannWindow" | "HammingWindow" | "BlackmanWindow" => &[0],
        "MelWeightMatrix" => &[0, 1, 2, 3, 4],
        "Loop" => &[0],
        _ => &[],
    }
}

/// The state a translation function sees: the node, its opset, its inputs
/// and the device ops go to.
pub(crate) struct Ctx<'a> {
    pub node: &'a NodeProto,
    pub opset: i64,
    pub device: Device,
    inputs: Vec<Option<Val>>,
    location: Location,
    /// The constants this node's translation made (the handles are kept,
    /// so no other handle can reuse their addresses meanwhile).
    made: RefCell<Vec<(TensorHandle, DenseHostTensor)>>,
}

/// Translates the nodes of a graph in order. `values` holds the graph's
/// inputs and initializers and receives every node's outputs.
pub(crate) fn run_nodes(
    nodes: &[NodeProto],
    opset: i64,
    device: Device,
    values: &mut HashMap<String, Val>,
) -> Result<()> {
    for node in nodes {
        let node_ref = node_ref(node, opset);
        translate_node(node, opset, device, values).map_err(|e| e.at_node(&node_ref))?;
    }
    Ok(())
}

/// The [`NodeRef`] errors name for `node`.
pub(crate) fn node_ref(node: &NodeProto, opset: i64) -> NodeRef {
    NodeRef {
        name: node.name().to_string(),
        op_type: node.op_type().to_string(),
        opset,
    }
}

/// Runs a translation function; a panic inside (a bug, never the user's
/// input) becomes an internal error instead of unwinding through the
/// caller.
fn guarded(translate: Translate, ctx: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| translate(ctx))) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(OnnxError::new(
                OnnxErrorKind::Runtime,
                format!("internal error: the translation panicked: {msg}"),
            ))
        }
    }
}

fn translate_node(
    node: &NodeProto,
    opset: i64,
    device: Device,
    values: &mut HashMap<String, Val>,
) -> Result<()> {
    if !in_domain(node.domain(), node.op_type()) {
        return Err(OnnxError::unsupported(format!(
            "op {} of domain '{}'",
            node.op_type(),
            node.domain()
        )));
    }
    if control::is_control(node.op_type()) {
        let inputs = node_inputs(node, values)?;
        let outputs = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            control::translate(node, opset, device, inputs, values)
        }))
        .unwrap_or_else(|_| {
            Err(OnnxError::new(
                OnnxErrorKind::Runtime,
                "internal error: the translation panicked",
            ))
        })?;
        return bind_outputs(node, outputs, values);
    }
    let translate = lookup(node.op_type()).ok_or_else(|| {
        OnnxError::unsupported(format!(
            "{} (opset {opset}): no translation for this op",
            node.op_type()
        ))
    })?;
    let inputs = node_inputs(node, values)?;
    let all_known = inputs.iter().flatten().all(|v| v.known.is_some());
    let cpu = Device::cpu();
    let outputs: Vec<Val> = if all_known && device != cpu && !is_random(node.op_type()) {
        // Fold: run the node on the CPU now; its results become constants
        // of the translation's device.
        let folded_inputs = inputs
            .iter()
            .map(|v| {
                v.as_ref().map(|v| {
                    let known = v.known.clone().expect("checked above");
                    Val {
                        handle: TensorHandle::available(cpu, HostTensor::from(known.clone())),
                        known: Some(known),
                    }
                })
            })
            .collect();
        let ctx = Ctx::new(node, opset, cpu, folded_inputs);
        let handles = guarded(translate, &ctx)?;
        handles
            .into_iter()
            .map(|h| {
                let value = h.wait().and_then(|v| v.to_dense())?;
                Ok(Val {
                    handle: TensorHandle::available(device, value.clone().into()),
                    known: Some(value),
                })
            })
            .collect::<Result<_>>()?
    } else {
        let ctx = Ctx::new(node, opset, device, inputs);
        let handles = guarded(translate, &ctx)?;
        handles
            .into_iter()
            .map(|h| {
                // Constants the translation made (`Shape` and friends) are
                // known; so is everything computed eagerly from known inputs.
                let known = if device == cpu && all_known {
                    Some(h.wait().and_then(|v| v.to_dense())?)
                } else {
                    ctx.made
                        .borrow()
                        .iter()
                        .find(|(m, _)| m.ptr_eq(&h))
                        .map(|(_, v)| v.clone())
                };
                Ok(Val { handle: h, known })
            })
            .collect::<Result<_>>()?
    };
    bind_outputs(node, outputs, values)
}

/// The values of `node`'s inputs (`None` for an absent optional one).
fn node_inputs(node: &NodeProto, values: &HashMap<String, Val>) -> Result<Vec<Option<Val>>> {
    node.input
        .iter()
        .map(|name| {
            if name.is_empty() {
                Ok(None)
            } else {
                values.get(name).cloned().map(Some).ok_or_else(|| {
                    OnnxError::invalid(format!("input '{name}' is not defined before this node"))
                })
            }
        })
        .collect()
}

/// Binds `node`'s output names to `outputs`.
fn bind_outputs(
    node: &NodeProto,
    outputs: Vec<Val>,
    values: &mut HashMap<String, Val>,
) -> Result<()> {
    for (i, name) in node.output.iter().enumerate() {
        if name.is_empty() {
            continue;
        }
        let val = outputs.get(i).cloned().ok_or_else(|| {
            OnnxError::unsupported(format!(
                "output {i} ('{name}') of {} is not produced",
                node.op_type()
            ))
        })?;
        values.insert(name.clone(), val);
    }
    Ok(())
}

fn is_random(op_type: &str) -> bool {
    op_type.starts_with("Random") || op_type == "Bernoulli"
}

impl<'a> Ctx<'a> {
    fn new(node: &'a NodeProto, opset: i64, device: Device, inputs: Vec<Option<Val>>) -> Self {
        Ctx {
            node,
            opset,
            device,
            inputs,
            location: Location::caller(),
            made: RefCell::new(Vec::new()),
        }
    }

    /// Every input slot (`None` for an absent optional input).
    pub fn inputs_vals(&self) -> Vec<Option<Val>> {
        self.inputs.clone()
    }

    /// A context for the same node and device with other inputs: for a
    /// translation that rewrites an input (a cast) and reuses another.
    pub fn with_inputs(&self, inputs: Vec<Option<Val>>) -> Ctx<'a> {
        Ctx::new(self.node, self.opset, self.device, inputs)
    }

    /// The op type.
    pub fn op_type(&self) -> &str {
        self.node.op_type()
    }

    /// Input `i`, if present.
    pub fn opt_input(&self, i: usize) -> Option<&TensorHandle> {
        self.inputs
            .get(i)
            .and_then(|v| v.as_ref())
            .map(|v| &v.handle)
    }

    /// Input `i`, which must be present.
    pub fn input(&self, i: usize) -> Result<TensorHandle> {
        self.opt_input(i)
            .cloned()
            .ok_or_else(|| OnnxError::invalid(format!("{} needs input {i}", self.node.op_type())))
    }

    /// Every present input, in order.
    pub fn inputs(&self) -> Vec<TensorHandle> {
        self.inputs
            .iter()
            .flatten()
            .map(|v| v.handle.clone())
            .collect()
    }

    /// The known contents of input `i`, if the input is present and known.
    pub fn known(&self, i: usize) -> Option<&DenseHostTensor> {
        self.inputs
            .get(i)
            .and_then(|v| v.as_ref())
            .and_then(|v| v.known.as_ref())
    }

    /// Input `i` as integers, which must be known before the model runs
    /// (shapes, axes, pads); `None` when the input is absent.
    pub fn known_ints(&self, i: usize) -> Result<Option<Vec<i64>>> {
        if self.opt_input(i).is_none() {
            return Ok(None);
        }
        let t = self.known(i).ok_or_else(|| {
            OnnxError::unsupported(format!(
                "input {i} of {} is computed while the model runs; it must be a constant",
                self.node.op_type()
            ))
        })?;
        Ok(Some(ints_of(t)?))
    }

    /// Input `i` as one float, which must be known; `None` when absent.
    pub fn known_f64(&self, i: usize) -> Result<Option<f64>> {
        if self.opt_input(i).is_none() {
            return Ok(None);
        }
        let t = self.known(i).ok_or_else(|| {
            OnnxError::unsupported(format!(
                "input {i} of {} is computed while the model runs; it must be a constant",
                self.node.op_type()
            ))
        })?;
        let v = t
            .get_scalar(0)
            .ok_or_else(|| OnnxError::invalid(format!("input {i} is empty")))?;
        Ok(Some(scalar_f64(v)))
    }

    fn attr(&self, name: &str) -> Option<&AttributeProto> {
        self.node.attribute.iter().find(|a| a.name() == name)
    }

    /// Whether the node sets attribute `name`.
    pub fn has_attr(&self, name: &str) -> bool {
        self.attr(name).is_some()
    }

    /// An integer attribute, or `default`.
    pub fn attr_int(&self, name: &str, default: i64) -> i64 {
        self.attr(name).map_or(default, |a| a.i())
    }

    /// A float attribute, or `default`.
    pub fn attr_float(&self, name: &str, default: f32) -> f32 {
        self.attr(name).map_or(default, |a| a.f())
    }

    /// An integer-list attribute, if set.
    pub fn attr_ints(&self, name: &str) -> Option<Vec<i64>> {
        self.attr(name).map(|a| a.ints.clone())
    }

    /// A string attribute, or `default`.
    pub fn attr_str(&self, name: &str, default: &str) -> String {
        self.attr(name).map_or(default.to_string(), |a| {
            String::from_utf8_lossy(a.s()).into_owned()
        })
    }

    /// A tensor attribute, if set.
    pub fn attr_tensor(&self, name: &str) -> Result<Option<DenseHostTensor>> {
        match self.attr(name) {
            Some(a) if a.r#type() == AttributeType::Tensor || a.t.is_some() => match &a.t {
                Some(t) => crate::tensor::decode(t).map(Some),
                None => Err(OnnxError::invalid(format!(
                    "attribute {name} has no tensor"
                ))),
            },
            Some(a) => Err(OnnxError::unsupported(format!(
                "attribute {name} of type {}",
                a.r#type().as_str_name()
            ))),
            None => Ok(None),
        }
    }

    /// Runs `op` on the translation's device; an error of the op (caught
    /// by its metadata function) is returned, tagged later with the node.
    pub fn op(
        &self,
        op: &'static OpDef,
        args: &[TensorHandle],
        attrs: &OpAttrs,
    ) -> Result<Vec<TensorHandle>> {
        let args: Args = args.iter().cloned().collect();
        let results = execute(op, self.device, self.location, args, attrs.into());
        for r in &results {
            if let Some(e) = r.resolved_error() {
                return Err(OnnxError::new(
                    OnnxErrorKind::Runtime,
                    format!("{}: {}", op.name, e.message()),
                ));
            }
        }
        Ok(results.into_iter().collect())
    }

    /// [`Ctx::op`] for an op with one output.
    pub fn op1(
        &self,
        op: &'static OpDef,
        args: &[TensorHandle],
        attrs: &OpAttrs,
    ) -> Result<TensorHandle> {
        self.op(op, args, attrs)?
            .into_iter()
            .next()
            .ok_or_else(|| OnnxError::new(OnnxErrorKind::Runtime, "an op returned no result"))
    }

    /// A constant on the translation's device.
    pub fn constant(&self, value: DenseHostTensor) -> TensorHandle {
        let h = TensorHandle::available(self.device, value.clone().into());
        self.made.borrow_mut().push((h.clone(), value));
        h
    }

    /// A scalar constant of `dtype` holding `value`.
    pub fn scalar(&self, value: f64, dtype: DType) -> Result<TensorHandle> {
        let host = HostTensor::filled(
            Scalar::F64(value).cast(dtype),
            &TensorMetadata::new(dtype, Shape::scalar()),
        );
        Ok(self.constant(host.to_dense()?))
    }

    /// An i64 vector constant.
    pub fn ints_constant(&self, values: &[i64]) -> Result<TensorHandle> {
        Ok(self.constant(DenseHostTensor::from_slice(values, [values.len()])?))
    }

    /// `x` reshaped to `dims`.
    pub fn reshape(&self, x: &TensorHandle, dims: &[usize]) -> Result<TensorHandle> {
        if x.metadata().shape.dims() == dims {
            return Ok(x.clone());
        }
        let mut a = OpAttrs::new();
        a.set_dims("shape", dims);
        self.op1(&stagecraft_ops::RESHAPE, std::slice::from_ref(x), &a)
    }

    /// `x` cast to `dtype` (no op when it has that dtype).
    pub fn cast(&self, x: &TensorHandle, dtype: DType) -> Result<TensorHandle> {
        if x.dtype() == dtype {
            return Ok(x.clone());
        }
        let mut a = OpAttrs::new();
        a.set_dtype("dtype", dtype);
        self.op1(&stagecraft_ops::CAST, std::slice::from_ref(x), &a)
    }

    /// A binary elementwise op with NumPy broadcasting.
    pub fn binary(
        &self,
        op: &'static OpDef,
        a: &TensorHandle,
        b: &TensorHandle,
    ) -> Result<TensorHandle> {
        self.op1(op, &[a.clone(), b.clone()], &OpAttrs::new())
    }

    /// A unary elementwise op.
    pub fn unary(&self, op: &'static OpDef, x: &TensorHandle) -> Result<TensorHandle> {
        self.op1(op, std::slice::from_ref(x), &OpAttrs::new())
    }

    /// `x op c` for a scalar `c` of `x`'s dtype.
    pub fn with_scalar(
        &self,
        op: &'static OpDef,
        x: &TensorHandle,
        c: f64,
    ) -> Result<TensorHandle> {
        let c = self.scalar(c, x.dtype())?;
        self.binary(op, x, &c)
    }
}

/// The dims of a handle.
pub(crate) fn dims(h: &TensorHandle) -> Vec<usize> {
    h.metadata().shape.dims().to_vec()
}

/// A known tensor's values as integers (from any integer or float dtype).
pub(crate) fn ints_of(t: &DenseHostTensor) -> Result<Vec<i64>> {
    (0..t.numel())
        .map(|i| {
            let s = t
                .get_scalar(i)
                .ok_or_else(|| OnnxError::invalid("cannot read a constant"))?;
            // Integers exactly (a u64 above i64::MAX wraps), floats
            // truncated.
            Ok(s.to_i64())
        })
        .collect()
}

/// A scalar as f64.
pub(crate) fn scalar_f64(s: Scalar) -> f64 {
    match s.cast(DType::F64) {
        Scalar::F64(v) => v,
        _ => f64::NAN,
    }
}

/// Normalizes a possibly negative `axis` of a tensor of `rank`.
pub(crate) fn axis(axis: i64, rank: usize) -> Result<usize> {
    let r = rank as i64;
    if axis < -r || axis >= r {
        return Err(OnnxError::invalid(format!(
            "axis {axis} is out of range for rank {rank}"
        )));
    }
    Ok(if axis < 0 { axis + r } else { axis } as usize)
}

/// Requires a float input: the ops that call it have no integer meaning
/// in stagecraft (or none ONNX defines), so another dtype is unsupported.
pub(crate) fn require_float(c: &Ctx<'_>, x: &TensorHandle) -> Result<()> {
    if x.dtype().is_float() {
        Ok(())
    } else {
        Err(OnnxError::unsupported(format!(
            "{} on {} tensors",
            c.op_type(),
            x.dtype()
        )))
    }
}
