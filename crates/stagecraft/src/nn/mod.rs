//! Layers and models: the [`Module`] trait and parameters visited by name.
//!
//! A module owns its parameters as plain [`Tensor<f32>`] values. Tensors
//! are immutable, so training replaces them: an optimizer (see
//! [`crate::optim`]) and [`Module::visit_params_mut`] swap in the updated
//! values. A parameter's name is its dot-separated path from the root
//! module (`blocks.0.attn.qkv.weight`), the key it has in a safetensors
//! file.
//!
//! The layers ([`Linear`], [`Embedding`], [`LayerNorm`], [`RmsNorm`],
//! [`Conv2d`], [`Dropout`], [`Activation`], [`CausalSelfAttention`],
//! [`MultiHeadAttention`]) keep PyTorch's parameter layouts and names, so
//! a PyTorch or nanoGPT checkpoint converted to safetensors loads with
//! [`load`]. Float-in, float-out layers also implement [`Forward`], which
//! lets [`Sequential`] chain them.
//!
//! # Weight tying
//!
//! A model that reuses its token embedding as the output head (GPT-2,
//! nanoGPT) holds one [`Embedding`] and multiplies by its table directly:
//!
//! ```
//! use stagecraft::nn::{Embedding, Module};
//! use stagecraft::{Device, Rng, Tensor};
//!
//! struct TinyLm {
//!     wte: Embedding,
//! }
//!
//! impl Module for TinyLm {
//!     fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
//!         // The head has no parameter of its own: the table is visited
//!         // once, under the embedding's name.
//!         self.wte.visit_params(&stagecraft::nn::join(prefix, "wte"), f);
//!     }
//!     fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
//!         self.wte.visit_params_mut(&stagecraft::nn::join(prefix, "wte"), f);
//!     }
//! }
//!
//! impl TinyLm {
//!     fn logits(&self, ids: &Tensor<i64>) -> Tensor<f32> {
//!         let h = self.wte.forward_ids(ids);
//!         h.linear(&self.wte.weight, None)
//!     }
//! }
//!
//! let cpu = Device::cpu();
//! let lm = TinyLm { wte: Embedding::new(5, 3, &mut Rng::new(0), &cpu) };
//! let ids = Tensor::<i64>::from_vec(vec![1, 4], &[2], &cpu)?;
//! assert_eq!(lm.logits(&ids).dims(), &[2, 5]);
//! # Ok::<(), stagecraft::Error>(())
//! ```
//!
//! Both uses read the same tensor, so after `requires_grad` the tape adds
//! the two contributions and `backward` returns one gradient, the sum, for
//! the one parameter an optimizer sees.

mod activation;
mod attention;
mod conv;
mod dropout;
mod embedding;
pub mod init;
mod linear;
mod norm;
mod safetensors;
mod sequential;

pub use activation::Activation;
pub use attention::{CausalSelfAttention, KvCache, MultiHeadAttention};
pub use conv::Conv2d;
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use linear::Linear;
pub use norm::{LayerNorm, RmsNorm};
pub use safetensors::{
    load, load_from_bytes, read_metadata, save, save_to_bytes, save_with_metadata,
};
pub use sequential::Sequential;

use crate::Tensor;

/// A layer that maps one float tensor to another: what [`Sequential`]
/// chains. Layers whose input is not one float tensor (an [`Embedding`]
/// takes ids, attention may take two inputs) have their own methods.
pub trait Forward {
    /// The layer applied to `x`.
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32>;
}

/// A [`Forward`] layer with parameters: what [`Sequential`] stores.
/// Implemented for every type that is both.
pub trait Layer: Forward + Module {}

impl<L: Forward + Module + ?Sized> Layer for L {}

/// Something with named parameters: a layer or a whole model.
///
/// Implementations visit their parameters in a fixed order, and a
/// parameter shared by two layers (weight tying) is visited once, by the
/// module that owns it: the other layer reads it from there, so its
/// gradient is the sum of both uses.
pub trait Module {
    /// Calls `f` with the full name (`prefix` joined to the local name with
    /// [`join`]) and the value of each parameter.
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>));

    /// Calls `f` with the full name of each parameter and a place to store
    /// its new value, in the same order as [`Module::visit_params`].
    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>));

    /// Switches training mode (dropout active) on or off, recursively.
    /// Modules without such behaviour keep the default, which does nothing.
    fn set_training(&mut self, _training: bool) {}
}

/// `prefix.name`, or `name` when `prefix` is empty.
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// Visits a layer's `weight` and `bias` under `prefix`, skipping absent
/// ones: the parameters of every layer made of a weight and a bias.
pub(crate) fn visit_weight_bias(
    prefix: &str,
    weight: Option<&Tensor<f32>>,
    bias: Option<&Tensor<f32>>,
    f: &mut dyn FnMut(&str, &Tensor<f32>),
) {
    for (name, t) in [("weight", weight), ("bias", bias)] {
        if let Some(t) = t {
            f(&join(prefix, name), t);
        }
    }
}

/// [`visit_weight_bias`] with places to store new values.
pub(crate) fn visit_weight_bias_mut(
    prefix: &str,
    weight: Option<&mut Tensor<f32>>,
    bias: Option<&mut Tensor<f32>>,
    f: &mut dyn FnMut(&str, &mut Tensor<f32>),
) {
    for (name, t) in [("weight", weight), ("bias", bias)] {
        if let Some(t) = t {
            f(&join(prefix, name), t);
        }
    }
}

/// Conveniences every [`Module`] gets.
pub trait ModuleExt: Module {
    /// Every parameter with its full name, in visiting order.
    fn named_params(&self) -> Vec<(String, Tensor<f32>)> {
        let mut out = Vec::new();
        self.visit_params("", &mut |name, t| out.push((name.to_string(), t.clone())));
        out
    }

    /// The number of scalar parameters.
    fn num_params(&self) -> usize {
        let mut n = 0;
        self.visit_params("", &mut |_, t| n += t.dims().iter().product::<usize>());
        n
    }

    /// Marks every parameter with [`Tensor::requires_grad`], so that
    /// `loss.backward()` returns gradients for all of them. Call it once,
    /// before training: optimizer steps keep the mark on the updated
    /// parameters.
    fn requires_grad(&self) {
        self.visit_params("", &mut |_, t| {
            t.requires_grad();
        });
    }

    /// Training mode: dropout active.
    fn train(&mut self) {
        self.set_training(true);
    }

    /// Evaluation mode: dropout is the identity.
    fn eval(&mut self) {
        self.set_training(false);
    }
}

impl<M: Module + ?Sized> ModuleExt for M {}
