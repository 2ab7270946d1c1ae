//! Layers and models: the [`Module`] trait and parameters visited by name.
//!
//! A module owns its parameters as plain [`Tensor<f32>`] values. Tensors
//! are immutable, so training replaces them: an optimizer (see
//! [`crate::optim`]) and [`Module::visit_params_mut`] swap in the updated
//! values. A parameter's name is its dot-separated path from the root
//! module (`blocks.0.attn.qkv.weight`), the key it has in a safetensors
//! file.

use crate::Tensor;

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

    /// Marks every parameter as a variable of the current tape, so that
    /// `loss.backward()` returns gradients for all of them. Call it before
    /// the forward pass of each step.
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
