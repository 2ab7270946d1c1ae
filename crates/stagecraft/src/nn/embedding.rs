//! The lookup table of token (or position) vectors.

use super::{init, join, Module};
use crate::{Device, IndexElement, Rng, Tensor};

/// A table of `num_embeddings` vectors of `embedding_dim` values, PyTorch's
/// `nn.Embedding`: `weight` is `[V, D]`.
///
/// It takes integer ids, not floats, so it has [`Embedding::forward_ids`]
/// rather than [`super::Forward`]. For a tied output head, use `weight`
/// directly: see the [module documentation](super#weight-tying).
#[derive(Clone, Debug)]
pub struct Embedding {
    /// `[V, D]`.
    pub weight: Tensor<f32>,
}

impl Embedding {
    /// A `[num_embeddings, embedding_dim]` table drawn from the standard
    /// normal distribution, as PyTorch initializes it.
    pub fn new(
        num_embeddings: usize,
        embedding_dim: usize,
        rng: &mut Rng,
        device: &Device,
    ) -> Embedding {
        Embedding::with_std(num_embeddings, embedding_dim, 1.0, rng, device)
    }

    /// A table drawn from a normal distribution with mean 0 and `std`
    /// (GPT-2 and nanoGPT use 0.02).
    pub fn with_std(
        num_embeddings: usize,
        embedding_dim: usize,
        std: f64,
        rng: &mut Rng,
        device: &Device,
    ) -> Embedding {
        let weight = init::normal(&[num_embeddings, embedding_dim], 0.0, std, rng, device);
        Embedding { weight }
    }

    /// A table with the given `[V, D]` values.
    pub fn with_weight(weight: Tensor<f32>) -> Embedding {
        Embedding { weight }
    }

    /// The rows picked by `ids` (any shape): `[.., D]`. An id outside
    /// `[0, V)` is an error of the `Embedding` op at the caller's line.
    #[track_caller]
    pub fn forward_ids<I: IndexElement>(&self, ids: &Tensor<I>) -> Tensor<f32> {
        self.weight.embedding(ids)
    }
}

impl Module for Embedding {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        f(&join(prefix, "weight"), &self.weight);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        f(&join(prefix, "weight"), &mut self.weight);
    }
}
