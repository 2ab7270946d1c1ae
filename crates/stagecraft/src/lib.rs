//! stagecraft: a tensor runtime for plain, imperative tensor code.
//!
//! Write ordinary Rust against [`Tensor<T>`]; each op runs through the core
//! runtime on the device it is placed on (explicit [`with_device`] scope,
//! else the inputs' device, else the default device). Errors are values:
//! an invalid op yields a tensor holding an error that names the op, the
//! shapes and your source line, and reading it returns that error.
//!
//! ```
//! use stagecraft::{Device, Tensor};
//! let cpu = Device::cpu();
//! let x = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], &cpu)?;
//! let y = (&x * 2.0 + 1.0).relu().sum(&[-1], false);
//! assert_eq!(y.to_vec()?, vec![8.0, 16.0]);
//! # Ok::<(), stagecraft::Error>(())
//! ```
//!
//! Mixing element types does not compile:
//!
//! ```compile_fail
//! use stagecraft::{Device, Tensor};
//! let cpu = Device::cpu();
//! let a = Tensor::<f32>::zeros(&[2], &cpu);
//! let b = Tensor::<f64>::zeros(&[2], &cpu);
//! let _ = a + b;
//! ```

mod autodiff;
pub mod distributed;
pub mod lazy;
pub mod nn;
pub mod onnx;
mod operators;
mod ops;
pub mod optim;
mod random;
mod stage;
mod staging;
mod tensor;

pub use autodiff::{grad, is_grad_enabled, no_grad, value_and_grad, Gradients};
pub use ops::{
    clip_grad_norm, scaled_dot_product_attention, where_, Conv1dOptions, Conv2dOptions,
    ConvTranspose2dOptions, CrossEntropyOptions, CumsumOptions, Pool2dOptions, Reduction,
};
pub use random::Rng;
pub use stage::{__stage, host_call, host_call_with, staged_graphs};
pub use stagecraft_macros::{stage, TensorGroup};
pub use stagecraft_ops::{BinaryOp, UnaryOp};
/// Transfer guards: what implicit copies between devices do on this thread
/// (reads of device values, and eager ops' arguments copied to the device
/// the op runs on).
///
/// ```
/// use stagecraft::{transfer_guard, Device, Tensor, TransferGuard};
/// let x = Tensor::<f32>::ones(&[2], &Device::cpu());
/// transfer_guard(TransferGuard::Disallow, || {
///     assert!(x.to_vec().is_err());                              // implicit: refused
///     assert_eq!(x.to_host().to_vec().unwrap(), vec![1.0, 1.0]); // explicit
/// });
/// ```
pub use stagecraft_runtime::{
    current_transfer_guard, take_transfer_log, transfer_guard, transfer_stats, TransferGuard,
    TransferStats,
};
pub use staging::{cond, function, while_loop, StagedFunction, TensorGroup};
pub use tensor::Tensor;

pub use stagecraft_runtime::{
    cancel_execution, restart, set_diagnostic_handler, with_device, with_execution_mode, Device,
    ExecutionMode,
};
pub use stagecraft_tensor::{
    bf16, f16, DType, Element, Error, ErrorKind, FloatElement, IndexElement, IntElement, Location,
    NumElement, Result, Shape,
};

/// The README's Rust samples, compiled and run as doctests (`cargo test
/// --doc`), so that they keep compiling and every value they say they
/// print is checked.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
mod readme {}

/// The layers underneath, for code that works below the typed API.
pub mod layers {
    pub use stagecraft_cpu as cpu;
    pub use stagecraft_graph as graph;
    pub use stagecraft_ops as ops;
    pub use stagecraft_runtime as runtime;
    /// The GPU device crate (feature `wgpu`).
    #[cfg(feature = "wgpu")]
    pub use stagecraft_runtime::stagecraft_wgpu as wgpu;
    pub use stagecraft_tensor as tensor;
}
