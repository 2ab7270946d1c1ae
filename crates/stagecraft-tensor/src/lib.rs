//! The bottom layer of stagecraft: element types, shapes, errors with source
//! locations, aligned reference-counted buffers and host tensors.
//!
//! Nothing here knows about ops, devices or execution; every other crate
//! builds on these types.

mod buffer;
mod device;
mod dtype;
mod error;
mod fxhash;
mod host;
mod shape;

pub use buffer::{Arena, Buffer, BufferStats, SMALL_BLOCK};
pub use device::{DeviceStorage, DeviceTensor, TensorValue};
pub use dtype::{DType, Element, FloatElement, IndexElement, IntElement, NumElement, Scalar};
pub use error::{Error, ErrorKind, Location, Result};
pub use fxhash::{FxBuild, FxHasher};
pub use host::{DenseHostTensor, HostTensor, ScalarHostTensor, TensorList};
pub use shape::{broadcast_shapes, element_count, normalize_axis, Shape, TensorMetadata};

pub use half::{bf16, f16};
