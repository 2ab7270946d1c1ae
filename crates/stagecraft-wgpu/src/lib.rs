//! The GPU device of stagecraft, on [wgpu]: tensors in device memory
//! ([`GpuBuffer`], pooled), copies between host and device ([`Gpu::upload`],
//! [`Gpu::download`]) and WGSL kernels ([`run`]), declared in one table
//! keyed by op and input dtypes ([`kernels`], [`lookup`]).
//!
//! The same shaders run on real GPUs (Vulkan, Metal, DX12) and on Mesa's
//! software Vulkan driver (lavapipe), which is how CI tests them. Elementwise
//! kernels are generated from the `wgsl:` expression in each op's one
//! definition (`stagecraft-ops`); no op's math is written here again. The
//! runtime's GPU op handler (`stagecraft-runtime`, feature `wgpu`) calls
//! [`run`] and runs any op this crate has no kernel for on the CPU.
//!
//! [wgpu]: https://wgpu.rs

mod buffer;
mod context;
mod conv;
mod indexing;
mod kernels;
mod random;
mod registry;
mod shader;
mod sort;
mod transformer;

pub use buffer::GpuBuffer;
pub use context::Gpu;
pub use indexing::{every_indexing_shader, fused_shader};
pub use kernels::{compile, every_elementwise_shader, fuses, run, Outputs};
pub use registry::{kernels, lookup, Accepts, GpuKernel, Launch};
