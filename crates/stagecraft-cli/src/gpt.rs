//! A character-level GPT in nanoGPT's architecture: token and position
//! embeddings, pre-norm blocks of causal self-attention and a 4× GELU MLP
//! without biases, a final layer norm, and an output head tied to the
//! token embedding. Parameter names follow nanoGPT's (`h.0.attn.c_attn.
//! weight`, without its `transformer.` prefix), so they are the keys of a
//! saved model.

use crate::splitmix::SplitMix64;
use stagecraft::nn::{
    init, join, CausalSelfAttention, Embedding, Forward, KvCache, LayerNorm, Linear, Module,
};
use stagecraft::{CrossEntropyOptions, Device, Error, Reduction, Rng, Tensor};

/// The shape of a GPT.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    /// Distinct tokens.
    pub vocab: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block.
    pub n_head: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// The longest sequence (the position table's length).
    pub block_size: usize,
    /// Dropout probability in training (0 turns it off).
    pub dropout: f64,
}

impl GptConfig {
    /// nanoGPT's CPU settings for Shakespeare: 4 layers of 4 heads, 128
    /// wide, a context of 64 characters, no dropout.
    pub fn small(vocab: usize) -> GptConfig {
        GptConfig {
            vocab,
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            block_size: 64,
            dropout: 0.0,
        }
    }
}

/// The MLP of a block: `C -> 4C`, GELU, `4C -> C`.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// `C -> 4C`.
    pub c_fc: Linear,
    /// `4C -> C`.
    pub c_proj: Linear,
}

impl Module for Mlp {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        self.c_fc.visit_params(&join(prefix, "c_fc"), f);
        self.c_proj.visit_params(&join(prefix, "c_proj"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        self.c_fc.visit_params_mut(&join(prefix, "c_fc"), f);
        self.c_proj.visit_params_mut(&join(prefix, "c_proj"), f);
    }
}

/// One pre-norm block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
#[derive(Clone, Debug)]
pub struct Block {
    /// Before attention.
    pub ln_1: LayerNorm,
    /// Causal self-attention.
    pub attn: CausalSelfAttention,
    /// Before the MLP.
    pub ln_2: LayerNorm,
    /// The MLP.
    pub mlp: Mlp,
}

impl Block {
    fn mlp(&self, x: &Tensor<f32>) -> Tensor<f32> {
        let h = self.mlp.c_fc.forward(&self.ln_2.forward(x)).gelu();
        let out = self.mlp.c_proj.forward(&h);
        // The block's residual dropout shares the attention's probability.
        self.attn.resid_dropout.forward(&out)
    }

    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        let x = x + &self.attn.forward(&self.ln_1.forward(x));
        &x + &self.mlp(&x)
    }

    fn forward_cached(&self, x: &Tensor<f32>, cache: &mut KvCache) -> Tensor<f32> {
        let x = x + &self.attn.forward_cached(&self.ln_1.forward(x), cache);
        &x + &self.mlp(&x)
    }
}

impl Module for Block {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        self.ln_1.visit_params(&join(prefix, "ln_1"), f);
        self.attn.visit_params(&join(prefix, "attn"), f);
        self.ln_2.visit_params(&join(prefix, "ln_2"), f);
        self.mlp.visit_params(&join(prefix, "mlp"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        self.ln_1.visit_params_mut(&join(prefix, "ln_1"), f);
        self.attn.visit_params_mut(&join(prefix, "attn"), f);
        self.ln_2.visit_params_mut(&join(prefix, "ln_2"), f);
        self.mlp.visit_params_mut(&join(prefix, "mlp"), f);
    }

    fn set_training(&mut self, training: bool) {
        self.attn.set_training(training);
    }
}

/// The model.
#[derive(Clone, Debug)]
pub struct Gpt {
    /// Its shape.
    pub config: GptConfig,
    /// Token embeddings, also the output head (tied).
    pub wte: Embedding,
    /// Position embeddings.
    pub wpe: Embedding,
    /// The blocks.
    pub h: Vec<Block>,
    /// The final norm.
    pub ln_f: LayerNorm,
}

/// Key/value caches of every block, for generation.
#[derive(Clone, Debug, Default)]
pub struct GptCache {
    layers: Vec<KvCache>,
}

impl GptCache {
    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, KvCache::len)
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Gpt {
    /// A model initialized as nanoGPT does, from `seed`: every matrix
    /// normal with std 0.02, the projections into the residual stream
    /// (`attn.c_proj`, `mlp.c_proj`) with `0.02/√(2·n_layer)`, norms at
    /// one.
    pub fn new(config: GptConfig, seed: u64, device: &Device) -> Gpt {
        let mut rng = Rng::new(seed);
        let c = config.n_embd;
        let std = 0.02;
        let proj_std = 0.02 / (2.0 * config.n_layer as f64).sqrt();
        let linear = |rows: usize, cols: usize, std: f64, rng: &mut Rng| {
            Linear::from_params(init::normal(&[rows, cols], 0.0, std, rng, device), None)
        };
        let wte = Embedding::with_std(config.vocab, c, std, &mut rng, device);
        let wpe = Embedding::with_std(config.block_size, c, std, &mut rng, device);
        let h = (0..config.n_layer)
            .map(|_| {
                let mut attn = CausalSelfAttention::new(
                    c,
                    config.n_head,
                    false,
                    config.dropout,
                    &mut rng,
                    device,
                );
                attn.c_attn = linear(3 * c, c, std, &mut rng);
                attn.c_proj = linear(c, c, proj_std, &mut rng);
                Block {
                    ln_1: LayerNorm::new(c, false, device),
                    attn,
                    ln_2: LayerNorm::new(c, false, device),
                    mlp: Mlp {
                        c_fc: linear(4 * c, c, std, &mut rng),
                        c_proj: linear(c, 4 * c, proj_std, &mut rng),
                    },
                }
            })
            .collect();
        Gpt {
            config,
            wte,
            wpe,
            h,
            ln_f: LayerNorm::new(c, false, device),
        }
    }

    /// The device the parameters are on.
    pub fn device(&self) -> Device {
        self.wte.weight.device()
    }

    /// The embeddings of `ids: [B, T]` at positions `start..start + T`, or
    /// an error of `Gpt` at the caller's line when they run past the
    /// context.
    #[track_caller]
    fn embed(&self, ids: &Tensor<i32>, start: usize) -> Tensor<f32> {
        let (t, block) = (
            ids.dims().last().copied().unwrap_or(0),
            self.config.block_size,
        );
        if ids.dims().len() != 2 || start + t > block {
            let what = if ids.dims().len() != 2 {
                format!(
                    "token ids of shape {:?}: expected [batch, time]",
                    ids.dims()
                )
            } else {
                format!(
                    "a sequence of {} positions is longer than the model's context of {block}",
                    start + t
                )
            };
            let mut dims = ids.dims().to_vec();
            dims.push(self.config.n_embd);
            return Tensor::failed("Gpt", Error::shape(what), &dims, &ids.device());
        }
        let positions: Vec<i32> = (start as i32..(start + t) as i32).collect();
        let pos =
            Tensor::from_vec(positions, &[t], &ids.device()).expect("positions match their shape");
        &self.wte.forward_ids(ids) + &self.wpe.forward_ids(&pos)
    }

    /// The head: normed activations times the token table (tied weights).
    fn logits(&self, x: &Tensor<f32>) -> Tensor<f32> {
        self.ln_f.forward(x).linear(&self.wte.weight, None)
    }

    /// Logits `[B, T, vocab]` of `ids: [B, T]` (`T` at most the context).
    /// Ids outside the vocabulary are an error of `Embedding`, a longer
    /// sequence an error of `Gpt`, each at the caller's line.
    #[track_caller]
    pub fn forward(&self, ids: &Tensor<i32>) -> Tensor<f32> {
        let mut x = self.embed(ids, 0);
        for block in &self.h {
            x = block.forward(&x);
        }
        self.logits(&x)
    }

    /// Mean cross-entropy of the next-token predictions for `ids` against
    /// `targets` (both `[B, T]`); a target shape unlike the logits' is an
    /// error of `CrossEntropy` at the caller's line.
    #[track_caller]
    pub fn loss(&self, ids: &Tensor<i32>, targets: &Tensor<i32>) -> Tensor<f32> {
        let options = CrossEntropyOptions {
            ignore_index: None,
            reduction: Reduction::Mean,
        };
        self.forward(ids).cross_entropy(targets, options)
    }

    /// Logits of the new positions `ids: [B, T]` that follow the ones in
    /// `cache`, whose keys and values are appended: each position costs
    /// its own work, not the whole context's.
    #[track_caller]
    pub fn forward_cached(&self, ids: &Tensor<i32>, cache: &mut GptCache) -> Tensor<f32> {
        cache.layers.resize_with(self.h.len(), KvCache::new);
        let mut x = self.embed(ids, cache.len());
        for (block, layer) in self.h.iter().zip(&mut cache.layers) {
            x = block.forward_cached(&x, layer);
        }
        self.logits(&x)
    }
}

impl Module for Gpt {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        self.wte.visit_params(&join(prefix, "wte"), f);
        self.wpe.visit_params(&join(prefix, "wpe"), f);
        for (i, block) in self.h.iter().enumerate() {
            block.visit_params(&join(prefix, &format!("h.{i}")), f);
        }
        self.ln_f.visit_params(&join(prefix, "ln_f"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        self.wte.visit_params_mut(&join(prefix, "wte"), f);
        self.wpe.visit_params_mut(&join(prefix, "wpe"), f);
        for (i, block) in self.h.iter_mut().enumerate() {
            block.visit_params_mut(&join(prefix, &format!("h.{i}")), f);
        }
        self.ln_f.visit_params_mut(&join(prefix, "ln_f"), f);
    }

    fn set_training(&mut self, training: bool) {
        for block in &mut self.h {
            block.set_training(training);
        }
    }
}

/// How to pick each next token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Logits are divided by it: below 1 sharpens, above flattens; 0
    /// picks the most likely token.
    pub temperature: f32,
    /// Only the `k` most likely tokens are candidates (`None`: all).
    pub top_k: Option<usize>,
    /// Seeds the draws.
    pub seed: u64,
}

/// The token drawn from one row of logits.
fn sample(logits: &[f32], sampling: &Sampling, draws: &mut SplitMix64) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if sampling.temperature <= 0.0 {
        return order[0] as u32;
    }
    let k = sampling.top_k.unwrap_or(order.len()).clamp(1, order.len());
    let top = &order[..k];
    let max = logits[top[0]] as f64;
    let weights: Vec<f64> = top
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / sampling.temperature as f64).exp())
        .collect();
    let mut u = draws.uniform() * weights.iter().sum::<f64>();
    for (&i, w) in top.iter().zip(&weights) {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    top[k - 1] as u32
}

/// What [`generate`] produced.
#[derive(Clone, Debug)]
pub struct Generated {
    /// The new tokens (not the prompt).
    pub tokens: Vec<u32>,
    /// Positions the model ran in all (prompt refills included).
    pub positions_computed: usize,
}

/// Samples `count` tokens after `prompt` (at least one token).
///
/// The context is a window over the text: when it would outgrow the
/// model's context it restarts from the last half of it. With `cached`,
/// each new token then runs one position against the key/value cache,
/// and a restart refills the cache with the kept half (so a token costs
/// about two positions on average however long the text); without, every
/// token runs its whole window. Both see the same windows, so they pick
/// the same tokens.
pub fn generate(
    model: &Gpt,
    prompt: &[u32],
    count: usize,
    sampling: &Sampling,
    cached: bool,
) -> stagecraft::Result<Generated> {
    let block = model.config.block_size;
    if prompt.is_empty() {
        return Err(Error::invalid(
            "generation needs a prompt of at least one token",
        ));
    }
    let device = model.device();
    let ids = |tokens: &[u32]| {
        let values: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        Tensor::from_vec(values, &[1, tokens.len()], &device)
    };
    let mut draws = SplitMix64::new(sampling.seed);
    let mut tokens = prompt.to_vec();
    // The prompt itself may be longer than the context: keep its end.
    let mut start = tokens.len().saturating_sub(block);
    let mut cache = GptCache::default();
    let mut positions_computed = 0;
    for _ in 0..count {
        if tokens.len() - start > block {
            start = tokens.len() - block / 2;
            cache = GptCache::default();
        }
        let logits = if cached {
            let fresh = &tokens[start + cache.len()..];
            positions_computed += fresh.len();
            model.forward_cached(&ids(fresh)?, &mut cache)
        } else {
            let window = &tokens[start..];
            positions_computed += window.len();
            model.forward(&ids(window)?)
        };
        let t = logits.dims()[1];
        let last = logits.narrow(1, t - 1, 1).to_vec()?;
        tokens.push(sample(&last, sampling, &mut draws));
    }
    Ok(Generated {
        tokens: tokens[prompt.len()..].to_vec(),
        positions_computed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft::nn::ModuleExt;

    fn tiny() -> GptConfig {
        GptConfig {
            vocab: 11,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            block_size: 6,
            dropout: 0.0,
        }
    }

    #[test]
    fn parameter_names_follow_nanogpt_and_the_head_is_tied() {
        let model = Gpt::new(tiny(), 1, &Device::cpu());
        let names: Vec<String> = model.named_params().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names[0], "wte.weight");
        assert!(names.contains(&"h.1.attn.c_attn.weight".to_string()));
        assert!(names.contains(&"h.0.mlp.c_proj.weight".to_string()));
        assert_eq!(names.last().unwrap(), "ln_f.weight");
        // No separate head: the token table is the only [vocab, C] matrix.
        assert!(!names.iter().any(|n| n.contains("head")));
    }

    #[test]
    fn sampling_is_seeded_and_respects_top_k() {
        let logits = [0.0, 5.0, 4.9, -3.0];
        let greedy = Sampling {
            temperature: 0.0,
            top_k: None,
            seed: 1,
        };
        assert_eq!(sample(&logits, &greedy, &mut SplitMix64::new(1)), 1);
        let top2 = Sampling {
            temperature: 1.0,
            top_k: Some(2),
            seed: 1,
        };
        let mut draws = SplitMix64::new(3);
        let picks: Vec<u32> = (0..200)
            .map(|_| sample(&logits, &top2, &mut draws))
            .collect();
        assert!(picks.iter().all(|&p| p == 1 || p == 2));
        assert!(picks.contains(&1) && picks.contains(&2));
        let mut again = SplitMix64::new(3);
        let repeat: Vec<u32> = (0..200)
            .map(|_| sample(&logits, &top2, &mut again))
            .collect();
        assert_eq!(picks, repeat);
    }
}
