//! The op registry: every op is defined once, here, with its inputs, typed
//! attributes, properties and metadata (shape and dtype) function.
//!
//! Device kernels live in the device crates (`stagecraft-cpu`) and are
//! registered per device kind against these definitions; the core runtime
//! runs the metadata function before any kernel, so shape, dtype and
//! attribute errors are found synchronously at the call.

mod attrs;
mod constant;
pub mod defs;
pub mod elementwise;
pub mod func;
pub mod grad;
mod op;
pub mod scalar;

pub use attrs::{AttrKind, AttrValue, FrozenOpAttrs, OpAttrs, OpAttrsRef};
pub use constant::ConstantKernels;
pub use defs::*;
pub use elementwise::{BinaryFn, BinaryVisitor, DTypeClass, UnaryFn, UnaryVisitor};
pub use func::{FuncId, FunctionSignature};
pub use grad::{GradBuilder, GradContext, GradFn, InputGrads, G};
pub use op::{
    AttrDefault, AttrSpec, Attrs, CompareOp, ControlOp, Effect, MetadataFn, OpDef, OpKind,
    OutputMetas, ReduceOp, ShapeKind,
};

/// Every registered op.
pub fn all_ops() -> &'static [&'static OpDef] {
    defs::ALL_OPS
}

/// Looks an op up by name (as printed in traces).
pub fn find_op(name: &str) -> Option<&'static OpDef> {
    defs::ALL_OPS.iter().copied().find(|op| op.name == name)
}
