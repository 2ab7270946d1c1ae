//! The graph IR: a [`Function`] has typed parameters, nodes (an op with
//! typed attributes, or a constant) wired by `(node, output)` edges, and
//! results. Functions live in the process-wide library
//! ([`Function::register`]) so that control-flow ops can name them.
//!
//! Around the IR: a text form that prints and parses back ([`text`]), a
//! Graphviz form ([`dot`]), the verifier ([`verify()`]) and the optimization
//! passes ([`passes`]).

pub mod autodiff;
pub mod dot;
mod ir;
pub mod passes;
pub mod svg;
pub mod text;
pub mod verify;

pub use ir::{Function, Node, NodeOp, Value};
pub use verify::verify;
