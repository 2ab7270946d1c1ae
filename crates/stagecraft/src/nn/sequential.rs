//! A chain of layers applied in order.

use super::{join, Forward, Layer, Module};
use crate::Tensor;

/// Layers applied one after another, PyTorch's `nn.Sequential`: layer `i`'s
/// parameters are named `i.weight`, ... under the chain's prefix.
///
/// ```
/// use stagecraft::nn::{Activation, Forward, Linear, ModuleExt, Sequential};
/// use stagecraft::{Device, Rng, Tensor};
/// let cpu = Device::cpu();
/// let mut rng = Rng::new(0);
/// let mlp = Sequential::new()
///     .push(Linear::new(4, 8, true, &mut rng, &cpu))
///     .push(Activation::Relu)
///     .push(Linear::new(8, 2, true, &mut rng, &cpu));
/// let names: Vec<String> = mlp.named_params().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]);
/// assert_eq!(mlp.forward(&Tensor::zeros(&[3, 4], &cpu)).dims(), &[3, 2]);
/// ```
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Layer>>,
}

impl Sequential {
    /// An empty chain (the identity).
    pub fn new() -> Sequential {
        Sequential::default()
    }

    /// The chain with `layer` appended.
    #[must_use]
    pub fn push<L: Layer + 'static>(mut self, layer: L) -> Sequential {
        self.layers.push(Box::new(layer));
        self
    }

    /// The number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether the chain has no layers.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Layer `i`, if there is one.
    pub fn get(&self, i: usize) -> Option<&dyn Layer> {
        self.layers.get(i).map(|l| &**l)
    }
}

impl std::fmt::Debug for Sequential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sequential({} layers)", self.layers.len())
    }
}

impl Forward for Sequential {
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        self.layers
            .iter()
            .fold(x.clone(), |h, layer| layer.forward(&h))
    }
}

impl Module for Sequential {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        for (i, layer) in self.layers.iter().enumerate() {
            layer.visit_params(&join(prefix, &i.to_string()), f);
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        for (i, layer) in self.layers.iter_mut().enumerate() {
            layer.visit_params_mut(&join(prefix, &i.to_string()), f);
        }
    }

    fn set_training(&mut self, training: bool) {
        for layer in &mut self.layers {
            layer.set_training(training);
        }
    }
}
