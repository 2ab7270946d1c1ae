//! Slow, obviously correct reference kernels, used by tests to check the
//! fast kernels. They compute in f64 on flat vectors with explicit index
//! arithmetic and favour clarity over speed.
//!
//! Each family lives in its own submodule, beside the kernel family it
//! checks.

pub mod attention;
pub mod creation;
pub mod elementwise;
pub mod indexing;
pub mod linalg;
pub mod nn;
pub mod reduce;
pub mod scan;
pub mod shape;
pub mod sort;
pub mod training;
pub mod transformer;
