//! The 2-D convolution layer.

use super::{init, visit_weight_bias, visit_weight_bias_mut, Forward, Module};
use crate::{Conv2dOptions, Device, Rng, Tensor};

/// PyTorch's `nn.Conv2d`: `[N, in, H, W] -> [N, out, H', W']`.
///
/// `weight` is `[out, in/groups, kh, kw]` and `bias` `[out]`, PyTorch's
/// layouts, so checkpoints map directly; stride, padding, dilation and
/// groups are in `options`.
#[derive(Clone, Debug)]
pub struct Conv2d {
    /// `[out, in/groups, kh, kw]`.
    pub weight: Tensor<f32>,
    /// `[out]`, when the layer has one.
    pub bias: Option<Tensor<f32>>,
    /// Stride, padding, dilation and groups.
    pub options: Conv2dOptions,
}

impl Conv2d {
    /// A convolution from `in_channels` to `out_channels` with a `kernel`
    /// of `[kh, kw]`, initialized as PyTorch does: weight and bias uniform
    /// in `±1/√fan_in`, `fan_in = in/groups·kh·kw`.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel: [usize; 2],
        options: Conv2dOptions,
        bias: bool,
        rng: &mut Rng,
        device: &Device,
    ) -> Conv2d {
        let per_group = in_channels / options.groups.max(1);
        let fan_in = (per_group * kernel[0] * kernel[1]).max(1);
        let bound = 1.0 / (fan_in as f64).sqrt();
        let dims = [out_channels, per_group, kernel[0], kernel[1]];
        let weight = init::uniform(&dims, -bound, bound, rng, device);
        let bias = bias.then(|| init::uniform(&[out_channels], -bound, bound, rng, device));
        Conv2d {
            weight,
            bias,
            options,
        }
    }
}

impl Forward for Conv2d {
    #[track_caller]
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        let y = x.conv2d(&self.weight, self.options);
        match &self.bias {
            // The bias is stored `[out]` as in PyTorch; it broadcasts over
            // the channel axis once shaped `[out, 1, 1]`.
            Some(b) => y + b.reshape(&[b.numel(), 1, 1]),
            None => y,
        }
    }
}

impl Module for Conv2d {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        visit_weight_bias(prefix, Some(&self.weight), self.bias.as_ref(), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        visit_weight_bias_mut(prefix, Some(&mut self.weight), self.bias.as_mut(), f);
    }
}
