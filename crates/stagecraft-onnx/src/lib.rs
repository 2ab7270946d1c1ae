//! ONNX import for stagecraft.
//!
//! [`Model::load`] decodes an `.onnx` file (protobuf types generated at
//! build time from the vendored `onnx.proto` of onnx 1.22.0) and
//! [`Model::run`] runs it: the graph is translated node by node into
//! stagecraft ops (per each node's opset version), traced once per input
//! signature into a graph `Function` so the passes, fusion and the
//! executor apply, and run. [`Model::run_with`] also runs it eagerly or on
//! the lazy device, with the same results.
//!
//! ```no_run
//! use stagecraft_onnx::Model;
//! use stagecraft_tensor::DenseHostTensor;
//! let model = Model::load("m.onnx")?;
//! let x = DenseHostTensor::from_slice(&[0.0f32; 4], [1, 4])?;
//! let outs = model.run(&[("input", x)])?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Errors never panic: a corrupt file, an unknown op, an unsupported
//! opset or dtype, a missing input or a wrong input shape is an
//! [`OnnxError`] naming the node (name, op type, opset) where it applies.
//! [`conformance`] runs the ONNX backend test suite.

pub mod conformance;
mod error;
mod export;
mod model;
mod tensor;
mod translate;

/// The ONNX protobuf types, generated from `proto/onnx.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/onnx.rs"));
}

pub use error::{NodeRef, OnnxError, OnnxErrorKind, Result};
pub use export::{export_function, export_to_bytes, ExportParam, EXPORT_OPSET};
pub use model::{describe_dims, Dim, Mode, Model, ModelInput, ValueInfo, MAX_OPSET};
pub use tensor::{decode as decode_tensor, dtype_of, encode as encode_tensor, onnx_type_of};
