//! Layer and RMS normalization over the last axis, each one fused op.

use super::{visit_weight_bias, visit_weight_bias_mut, Forward, Module};
use crate::{Device, Tensor};

/// PyTorch's `nn.LayerNorm` over the last axis of size `D`: `(x -
/// mean)/√(var + eps)·weight + bias`, with `weight` and `bias` `[D]`, each
/// optional (nanoGPT's `bias=False` models have no bias).
#[derive(Clone, Debug)]
pub struct LayerNorm {
    /// `[D]`, initialized to ones.
    pub weight: Option<Tensor<f32>>,
    /// `[D]`, initialized to zeros.
    pub bias: Option<Tensor<f32>>,
    /// Added to the variance; PyTorch's default is `1e-5`.
    pub eps: f64,
}

impl LayerNorm {
    /// A norm over `dim` values with a weight, a bias when `bias` is set,
    /// and `eps = 1e-5`.
    pub fn new(dim: usize, bias: bool, device: &Device) -> LayerNorm {
        LayerNorm {
            weight: Some(Tensor::ones(&[dim], device)),
            bias: bias.then(|| Tensor::zeros(&[dim], device)),
            eps: 1e-5,
        }
    }
}

impl Forward for LayerNorm {
    #[track_caller]
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        x.layer_norm(self.weight.as_ref(), self.bias.as_ref(), self.eps)
    }
}

impl Module for LayerNorm {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        visit_weight_bias(prefix, self.weight.as_ref(), self.bias.as_ref(), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        visit_weight_bias_mut(prefix, self.weight.as_mut(), self.bias.as_mut(), f);
    }
}

/// RMS normalization over the last axis (LLaMA's `RMSNorm`, PyTorch's
/// `nn.RMSNorm`): `x/√(mean(x²) + eps)·weight`, with an optional `[D]`
/// weight.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    /// `[D]`, initialized to ones.
    pub weight: Option<Tensor<f32>>,
    /// Added to the mean square; LLaMA uses `1e-5` or `1e-6`.
    pub eps: f64,
}

impl RmsNorm {
    /// A norm over `dim` values with a weight of ones and `eps = 1e-6`.
    pub fn new(dim: usize, device: &Device) -> RmsNorm {
        RmsNorm {
            weight: Some(Tensor::ones(&[dim], device)),
            eps: 1e-6,
        }
    }
}

impl Forward for RmsNorm {
    #[track_caller]
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        x.rms_norm(self.weight.as_ref(), self.eps)
    }
}

impl Module for RmsNorm {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        visit_weight_bias(prefix, self.weight.as_ref(), None, f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        visit_weight_bias_mut(prefix, self.weight.as_mut(), None, f);
    }
}
