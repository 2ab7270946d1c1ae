//! Parameter-free elementwise activations as layers.

use super::{Forward, Module};
use crate::Tensor;

/// An elementwise activation, as a layer for [`super::Sequential`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// `max(x, 0)`.
    Relu,
    /// The exact (erf) GELU, PyTorch's default.
    Gelu,
    /// GELU's tanh approximation (GPT-2's `approximate='tanh'`).
    GeluTanh,
    /// `tanh(x)`.
    Tanh,
    /// `1/(1 + e^-x)`.
    Sigmoid,
    /// `x·sigmoid(x)` (swish).
    Silu,
    /// `x` for `x ≥ 0`, else `slope·x`.
    LeakyRelu(f64),
}

impl Forward for Activation {
    #[track_caller]
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        match *self {
            Activation::Relu => x.relu(),
            Activation::Gelu => x.gelu(),
            Activation::GeluTanh => x.gelu_tanh(),
            Activation::Tanh => x.tanh(),
            Activation::Sigmoid => x.sigmoid(),
            Activation::Silu => x.silu(),
            Activation::LeakyRelu(slope) => x.leaky_relu(slope),
        }
    }
}

impl Module for Activation {
    fn visit_params(&self, _prefix: &str, _f: &mut dyn FnMut(&str, &Tensor<f32>)) {}

    fn visit_params_mut(&mut self, _prefix: &str, _f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {}
}
