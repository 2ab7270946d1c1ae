//! ONNX import: the `stagecraft-onnx` crate, with [`Tensor`]s as model
//! inputs.
//!
//! ```no_run
//! use stagecraft::{onnx, Device, Tensor};
//! let model = onnx::Model::load("m.onnx")?;
//! let x = Tensor::<f32>::zeros(&[1, 3, 224, 224], &Device::cpu());
//! let outs = model.run(&[("input", x)])?;
//! let y = onnx::to_tensor::<f32>(&outs[0])?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::{Device, Element, Tensor};
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::DenseHostTensor;

pub use stagecraft_onnx::*;

impl<T: Element> ModelInput for Tensor<T> {
    fn to_host(&self) -> stagecraft_onnx::Result<DenseHostTensor> {
        self.handle().to_host()
    }
}

/// A model output as a CPU [`Tensor`] (its dtype must be `T`'s).
pub fn to_tensor<T: Element>(value: &DenseHostTensor) -> crate::Result<Tensor<T>> {
    Tensor::try_from_handle(TensorHandle::available(Device::cpu(), value.clone().into()))
}
