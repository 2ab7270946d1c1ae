//! The op set, grouped by family. Adding an op is one definition in its
//! family's file and one line in [`ALL_OPS`].

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
mod transfer;

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
pub use transfer::*;

use crate::op::{OpDef, OutputMetas};
use smallvec::smallvec;
use stagecraft_tensor::{DType, Error, Result, TensorMetadata};

/// Every op, in a stable order.
pub static ALL_OPS: &[&OpDef] = &[
    // elementwise
    &NEG,
    &ABS,
    &EXP,
    &LOG,
    &SQRT,
    &RSQRT,
    &TANH,
    &SIGMOID,
    &RELU,
    &GELU,
    &SIN,
    &COS,
    &SIGN,
    &LOGICAL_NOT,
    &ADD,
    &SUB,
    &MUL,
    &DIV,
    &POW,
    &MAXIMUM,
    &MINIMUM,
    &LOGICAL_AND,
    &LOGICAL_OR,
    &EQUAL,
    &NOT_EQUAL,
    &LESS,
    &LESS_EQUAL,
    &GREATER,
    &GREATER_EQUAL,
    &SELECT,
    &CAST,
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
    // lists (the stacks of While gradients)
    &LIST_PUSH,
    &LIST_POP,
];

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
    if meta.dtype.is_int() {
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
