//! Dropout as a layer: a probability, a mode and its own random stream.

use super::{Forward, Module};
use crate::{Rng, Tensor};
use std::sync::Mutex;

/// Inverted dropout ([`Tensor::dropout`]) in training mode, the identity in
/// evaluation mode. A new layer is in training mode, as in PyTorch; switch
/// with [`super::ModuleExt::eval`] and [`super::ModuleExt::train`].
///
/// The layer owns its random stream, behind a mutex so that
/// [`Forward::forward`] can draw through `&self`: a layer built from the
/// same seed draws the same sequence of masks.
#[derive(Debug)]
pub struct Dropout {
    /// The probability of zeroing an element.
    pub p: f64,
    training: bool,
    rng: Mutex<Rng>,
}

impl Dropout {
    /// A layer zeroing with probability `p`, its masks drawn from `rng`
    /// (take a [`Rng::fork`] of the model's stream).
    pub fn new(p: f64, rng: Rng) -> Dropout {
        Dropout {
            p,
            training: true,
            rng: Mutex::new(rng),
        }
    }

    /// Whether the layer is in training mode.
    pub fn is_training(&self) -> bool {
        self.training
    }

    /// Whether a forward pass would change its input: training with `p >
    /// 0`. Attention uses it to keep the fused kernel when it would not.
    pub fn is_active(&self) -> bool {
        self.training && self.p > 0.0
    }
}

impl Clone for Dropout {
    fn clone(&self) -> Dropout {
        Dropout {
            p: self.p,
            training: self.training,
            rng: Mutex::new(self.rng.lock().unwrap_or_else(|e| e.into_inner()).clone()),
        }
    }
}

impl Forward for Dropout {
    #[track_caller]
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        if !self.training {
            return x.clone();
        }
        // A panic elsewhere while the lock was held leaves the stream
        // intact (drawing only advances a counter), so a poisoned lock is
        // still usable.
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        x.dropout(self.p, &mut rng)
    }
}

impl Module for Dropout {
    fn visit_params(&self, _prefix: &str, _f: &mut dyn FnMut(&str, &Tensor<f32>)) {}

    fn visit_params_mut(&mut self, _prefix: &str, _f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {}

    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
}
