//! The op set, grouped by family. Adding an op is one definition in its
//! family's file and one line in [`OTHER_OPS`]; a unary or binary
//! elementwise op is one entry of its table in `elementwise.rs` alone.

mod attention;
mod collective;
mod control;
mod creation;
mod effects;
mod elementwise;
mod fused;
mod host;
mod indexing;
mod linalg;
mod list;
mod nn;
mod reduce;
mod scan;
mod shape;
mod sort;
mod training;
mod transfer;
mod transformer;

pub use attention::*;
pub use collective::*;
pub use control::*;
pub use creation::*;
pub use effects::*;
pub use elementwise::*;
pub use fused::*;
pub use host::*;
pub use indexing::*;
pub use linalg::*;
pub use list::*;
pub use nn::*;
pub use reduce::*;
pub use scan::*;
pub use shape::*;
pub use sort::*;
pub use training::*;
pub use transfer::*;
pub use transformer::*;

use crate::op::{OpDef, OutputMetas};
use smallvec::smallvec;
use stagecraft_tensor::{DType, Error, Result, TensorMetadata};

/// Every op but the unary and binary elementwise ones, which
/// [`UnaryOp::ALL`] and [`BinaryOp::ALL`] list.
const OTHER_OPS: &[&OpDef] = &[
    // elementwise
    &EQUAL,
    &NOT_EQUAL,
    &LESS,
    &LESS_EQUAL,
    &GREATER,
    &GREATER_EQUAL,
    &SELECT,
    &CAST,
    &BITCAST,
    &FUSED_ELEMENTWISE,
    &FUSED_REDUCE,
    &FUSED_MATMUL,
    // creation
    &FILL,
    &ARANGE,
    &RANDOM_UNIFORM,
    &RANDOM_NORMAL,
    // reductions
    &SUM,
    &MEAN,
    &MAX,
    &MIN,
    &PROD,
    &ARGMAX,
    &ARGMIN,
    &SOFTMAX,
    &LOG_SOFTMAX,
    // sorting
    &SORT,
    &TOP_K,
    // scans
    &CUMSUM,
    // linear algebra
    &MATMUL,
    // shape and indexing
    &RESHAPE,
    &TRANSPOSE,
    &BROADCAST_TO,
    &CONCAT,
    &SLICE,
    &GATHER,
    &ONE_HOT,
    &PAD,
    &NONZERO,
    &GATHER_ELEMENTS,
    &SCATTER_ADD,
    &INDEX_ADD,
    &TRILU,
    // neural network
    &CONV2D,
    &MAX_POOL2D,
    &AVG_POOL2D,
    &CONV2D_BACKPROP_INPUT,
    &CONV2D_BACKPROP_FILTER,
    &MAX_POOL2D_GRAD,
    &AVG_POOL2D_GRAD,
    &CONV_TRANSPOSE2D,
    // training
    &DROPOUT,
    &SQUARED_NORM,
    &ADAM_UPDATE,
    &GELU_WITH_DERIVATIVE,
    // side effects
    &PRINT,
    &HOST_CALL,
    // control flow
    &IF,
    &WHILE,
    &CALL,
    // cross-device transfer
    &SEND,
    &RECV,
    // collectives across processes
    &ALL_REDUCE,
    &BROADCAST,
    &REDUCE_TO_ROOT,
    &ALL_GATHER,
    &REDUCE_SCATTER,
    &ALL_REDUCE_START,
    &ALL_REDUCE_DONE,
    // lists (the stacks of While gradients)
    &LIST_PUSH,
    &LIST_POP,
    // transformer blocks
    &EMBEDDING,
    &LAYER_NORM,
    &LAYER_NORM_GRAD,
    &RMS_NORM,
    &RMS_NORM_GRAD,
    &CROSS_ENTROPY,
    &CROSS_ENTROPY_GRAD,
    // attention
    &SCALED_DOT_PRODUCT_ATTENTION,
    &SCALED_DOT_PRODUCT_ATTENTION_GRAD,
];

const OP_COUNT: usize = UnaryOp::ALL.len() + BinaryOp::ALL.len() + OTHER_OPS.len();

/// Every op, in a stable order: the unary and binary elementwise ops in
/// their tables' order, then the rest.
pub static ALL_OPS: &[&OpDef] = &{
    let mut all: [&OpDef; OP_COUNT] = [&CAST; OP_COUNT];
    let mut i = 0;
    while i < UnaryOp::ALL.len() {
        all[i] = UnaryOp::ALL[i].def();
        i += 1;
    }
    let mut j = 0;
    while j < BinaryOp::ALL.len() {
        all[i + j] = BinaryOp::ALL[j].def();
        j += 1;
    }
    let mut k = 0;
    while k < OTHER_OPS.len() {
        all[i + j + k] = OTHER_OPS[k];
        k += 1;
    }
    all
};

/// One output.
pub(crate) fn one(meta: TensorMetadata) -> Result<OutputMetas> {
    Ok(smallvec![meta])
}

/// Requires a floating-point input.
pub(crate) fn require_float(role: &str, meta: &TensorMetadata) -> Result<()> {
    if meta.dtype.is_float() {
        Ok(())
    } else {
        Err(Error::dtype(format!(
            "{role} must be a floating-point tensor, got {meta}"
        )))
    }
}

/// Requires a numeric (non-bool) input.
pub(crate) fn require_numeric(role: &str, meta: &TensorMetadata) -> Result<()> {
    if meta.dtype.is_numeric() {
        Ok(())
    } else {
        Err(Error::dtype(format!("{role} must be numeric, got {meta}")))
    }
}

/// Requires an integer input (indices).
pub(crate) fn require_int(role: &str, meta: &TensorMetadata) -> Result<()> {
    if meta.dtype.is_index() {
        Ok(())
    } else {
        Err(Error::dtype(format!(
            "{role} must be an integer tensor (i32 or i64), got {meta}"
        )))
    }
}

/// Requires two inputs of the same dtype.
pub(crate) fn require_same_dtype(a: &TensorMetadata, b: &TensorMetadata) -> Result<DType> {
    if a.dtype == b.dtype {
        Ok(a.dtype)
    } else {
        Err(Error::dtype(format!(
            "operands must have the same dtype, got {a} and {b}"
        )))
    }
}
