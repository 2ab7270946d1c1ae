//! The library behind the `stagecraft` command: the MNIST IDX loader, the
//! models and their training loop, safetensors checkpoints, profiles and
//! trace pictures. The binary (`src/main.rs`) is only argument parsing on
//! top of this; the loaders are a library so tests and fuzz targets can
//! feed them bytes directly.

pub mod checkpoint;
pub mod error;
pub mod gpt;
pub mod idx;
pub mod lm;
pub mod mnist;
pub mod model;
pub mod npy;
pub mod onnx;
pub mod profile;
pub mod shakespeare;
pub mod splitmix;
pub mod trace;
pub mod train;
