//! The fully connected layer.

use super::{init, visit_weight_bias, visit_weight_bias_mut, Forward, Module};
use crate::{Device, Rng, Tensor};

/// `y = x·weightᵀ + bias`, PyTorch's `nn.Linear`.
///
/// `weight` is `[out, in]` and `bias` `[out]`, as in PyTorch, so
/// checkpoints map without transposing; the forward never materializes
/// the transpose (see [`Tensor::linear`]). Inputs may have any number of
/// leading dimensions: `[.., in] -> [.., out]`.
#[derive(Clone, Debug)]
pub struct Linear {
    /// `[out, in]`.
    pub weight: Tensor<f32>,
    /// `[out]`, when the layer has one.
    pub bias: Option<Tensor<f32>>,
}

impl Linear {
    /// A layer from `in_features` to `out_features`, initialized as
    /// PyTorch does: weight and bias uniform in `±1/√in_features` (its
    /// Kaiming-uniform with `a = √5`).
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        rng: &mut Rng,
        device: &Device,
    ) -> Linear {
        let bound = 1.0 / (in_features.max(1) as f64).sqrt();
        let weight = init::uniform(&[out_features, in_features], -bound, bound, rng, device);
        let bias = bias.then(|| init::uniform(&[out_features], -bound, bound, rng, device));
        Linear { weight, bias }
    }

    /// A layer with the given parameters (`weight: [out, in]`, `bias:
    /// [out]`).
    pub fn from_params(weight: Tensor<f32>, bias: Option<Tensor<f32>>) -> Linear {
        Linear { weight, bias }
    }

    /// `in_features`, the weight's second dimension.
    pub fn in_features(&self) -> usize {
        self.weight.dims().get(1).copied().unwrap_or(0)
    }

    /// `out_features`, the weight's first dimension.
    pub fn out_features(&self) -> usize {
        self.weight.dims().first().copied().unwrap_or(0)
    }
}

impl Forward for Linear {
    #[track_caller]
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        x.linear(&self.weight, self.bias.as_ref())
    }
}

impl Module for Linear {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        visit_weight_bias(prefix, Some(&self.weight), self.bias.as_ref(), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        visit_weight_bias_mut(prefix, Some(&mut self.weight), self.bias.as_mut(), f);
    }
}
