//! Multi-head attention layers: nanoGPT's causal self-attention (with a
//! key/value cache for generation) and a general multi-head attention.

use super::{join, Dropout, Forward, Linear, Module};
use crate::{Device, Error, Rng, Tensor};

/// `Ok` when `x` is `[B, T, width]`; else the tensor to return instead:
/// `x` itself when it already holds an error (which passes on), or an
/// error of `layer` at the caller's line.
#[track_caller]
fn check_input(x: &Tensor<f32>, width: usize, layer: &str) -> Result<(), Tensor<f32>> {
    if x.check().is_err() {
        return Err(x.clone());
    }
    if x.rank() == 3 && x.dims()[2] == width {
        return Ok(());
    }
    let err = Error::shape(format!(
        "the input is {:?}; the layer takes [batch, time, {width}]",
        x.dims()
    ));
    Err(Tensor::failed(layer, err, x.dims(), &x.device()))
}

/// `[B, T, H·D] -> [B, T, H, D]`, a reshape: the fused op reads heads in
/// this layout in place (a tensor of another rank is an error already,
/// reported by the op that made it, and passes on).
fn split_heads(x: &Tensor<f32>, n_head: usize) -> Tensor<f32> {
    match *x.dims() {
        [b, t, c] => x.reshape(&[b, t, n_head, c / n_head]),
        _ => x.clone(),
    }
}

/// `[B, T, H, D] -> [B, T, H·D]`, a reshape.
fn merge_heads(y: &Tensor<f32>) -> Tensor<f32> {
    match *y.dims() {
        [b, t, h, d] => y.reshape(&[b, t, h * d]),
        _ => y.clone(),
    }
}

/// `[B, T, H, D] <-> [B, H, T, D]`, for the products of
/// [`composite_attention`].
fn swap_heads(x: &Tensor<f32>) -> Tensor<f32> {
    if x.rank() == 4 {
        x.transpose(1, 2)
    } else {
        x.clone()
    }
}

/// Attention written out as matmul, mask, softmax (and dropout), matmul,
/// on `[B, T, H, D]` operands (transposed to `[B, H, T, D]` for the
/// products, and back): for what the fused op cannot do, a causal mask
/// aligned at the end (query `i` at absolute position `offset + i`, seeing
/// keys `0..=offset + i`) and dropout on the attention weights.
fn composite_attention(
    q: &Tensor<f32>,
    k: &Tensor<f32>,
    v: &Tensor<f32>,
    causal_offset: Option<usize>,
    dropout: Option<&Dropout>,
) -> Tensor<f32> {
    let (q, k, v) = (&swap_heads(q), &swap_heads(k), &swap_heads(v));
    let device = q.device();
    let (&[.., t, d], &[.., s, _]) = (q.dims(), k.dims()) else {
        return q.clone();
    };
    let scale = Tensor::scalar((1.0 / (d.max(1) as f64).sqrt()) as f32, &device);
    let mut scores = &q.matmul(&k.transpose(-2, -1)) * &scale;
    if let Some(offset) = causal_offset {
        // Built from aranges rather than host data, so the mask is part
        // of the graph on every device and in staged code.
        let rows = Tensor::<f32>::arange(offset as f64, (offset + t) as f64, 1.0, &device)
            .reshape(&[t, 1]);
        let cols = Tensor::<f32>::arange(0.0, s as f64, 1.0, &device).reshape(&[1, s]);
        let neg_inf = Tensor::scalar(f32::NEG_INFINITY, &device);
        scores = cols.le(&rows).select(&scores, &neg_inf);
    }
    let mut weights = scores.softmax(-1);
    if let Some(dropout) = dropout {
        weights = dropout.forward(&weights);
    }
    swap_heads(&weights.matmul(v))
}

/// The keys and values of the positions a [`CausalSelfAttention`] has
/// already seen, `[B, S, H, D]` each (the layout the fused attention
/// reads in place), so that generation feeds only the new tokens.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    /// Past keys, `[B, S, H, D]`; `None` before the first call.
    pub k: Option<Tensor<f32>>,
    /// Past values, `[B, S, H, D]`; `None` before the first call.
    pub v: Option<Tensor<f32>>,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> KvCache {
        KvCache::default()
    }

    /// The number of cached positions `S`.
    pub fn len(&self) -> usize {
        self.k
            .as_ref()
            .and_then(|k| k.dims().get(1).copied())
            .unwrap_or(0)
    }

    /// Whether no position is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every position (a new sequence).
    pub fn clear(&mut self) {
        self.k = None;
        self.v = None;
    }
}

/// nanoGPT's `CausalSelfAttention`: `[B, T, C] -> [B, T, C]` with
/// `n_head` heads of `C / n_head` values.
///
/// One `c_attn` projection gives queries, keys and values (`[3C, C]`, in
/// that order along its output, as in nanoGPT and GPT-2 checkpoints), one
/// fused [`Tensor::scaled_dot_product_attention_bthd`] call attends
/// causally, reading the heads in place,
/// and `c_proj` maps the heads back, followed by the residual dropout.
/// Dropout on the attention weights, which the fused op does not do, runs
/// the attention as separate ops, and only while it is active (training
/// with `p > 0`).
#[derive(Clone, Debug)]
pub struct CausalSelfAttention {
    /// `C -> 3C`: queries, keys, values.
    pub c_attn: Linear,
    /// `C -> C`, after the heads are merged.
    pub c_proj: Linear,
    /// The number of heads.
    pub n_head: usize,
    /// Dropout on the attention weights.
    pub attn_dropout: Dropout,
    /// Dropout on the output.
    pub resid_dropout: Dropout,
}

impl CausalSelfAttention {
    /// A layer for `n_embd` channels in `n_head` heads, with biases in
    /// both projections when `bias` is set and both dropouts at `dropout`
    /// (their streams forked from `rng`). Projections are initialized as
    /// [`Linear::new`] does; nanoGPT's own initialization (std 0.02) can
    /// be assigned to the public fields.
    ///
    /// # Panics
    ///
    /// When `n_head` is 0 or does not divide `n_embd`.
    pub fn new(
        n_embd: usize,
        n_head: usize,
        bias: bool,
        dropout: f64,
        rng: &mut Rng,
        device: &Device,
    ) -> CausalSelfAttention {
        assert!(
            n_head > 0 && n_embd.is_multiple_of(n_head),
            "CausalSelfAttention: n_head ({n_head}) must divide n_embd ({n_embd})"
        );
        CausalSelfAttention {
            c_attn: Linear::new(n_embd, 3 * n_embd, bias, rng, device),
            c_proj: Linear::new(n_embd, n_embd, bias, rng, device),
            n_head,
            attn_dropout: Dropout::new(dropout, rng.fork()),
            resid_dropout: Dropout::new(dropout, rng.fork()),
        }
    }

    /// Queries, keys and values of `x: [B, T, C]`, each `[B, H, T, D]`.
    fn qkv(&self, x: &Tensor<f32>) -> (Tensor<f32>, Tensor<f32>, Tensor<f32>) {
        let c = x.dims().get(2).copied().unwrap_or(0);
        let qkv = self.c_attn.forward(x);
        let part = |i: usize| split_heads(&qkv.narrow(2, i * c, c), self.n_head);
        (part(0), part(1), part(2))
    }

    fn output(&self, y: &Tensor<f32>) -> Tensor<f32> {
        self.resid_dropout
            .forward(&self.c_proj.forward(&merge_heads(y)))
    }

    /// Like [`Forward::forward`], but `x: [B, T, C]` holds only the new
    /// positions: those in `cache` come before them. Their keys and values
    /// are appended to the cache.
    ///
    /// With an empty cache this is the plain causal forward. With a
    /// single new position it sees every key, so the fused op runs
    /// without a mask. Several new positions after cached ones need a
    /// causal mask aligned at the end (the last query sees every key),
    /// which the fused op's upper-left alignment is not, so they run as
    /// separate ops with an explicit mask.
    #[track_caller]
    pub fn forward_cached(&self, x: &Tensor<f32>, cache: &mut KvCache) -> Tensor<f32> {
        if let Err(failed) = check_input(x, self.c_attn.in_features(), "CausalSelfAttention") {
            return failed;
        }
        let (q, k, v) = self.qkv(x);
        let past = cache.len();
        let (k, v) = match (&cache.k, &cache.v) {
            (Some(pk), Some(pv)) if past > 0 => {
                (Tensor::concat(&[pk, &k], 1), Tensor::concat(&[pv, &v], 1))
            }
            _ => (k, v),
        };
        let t = q.dims().get(1).copied().unwrap_or(0);
        let y = if self.attn_dropout.is_active() {
            composite_attention(&q, &k, &v, Some(past), Some(&self.attn_dropout))
        } else if past == 0 {
            q.scaled_dot_product_attention_bthd(&k, &v, true, None)
        } else if t == 1 {
            q.scaled_dot_product_attention_bthd(&k, &v, false, None)
        } else {
            composite_attention(&q, &k, &v, Some(past), None)
        };
        cache.k = Some(k);
        cache.v = Some(v);
        self.output(&y)
    }
}

impl Forward for CausalSelfAttention {
    #[track_caller]
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        if let Err(failed) = check_input(x, self.c_attn.in_features(), "CausalSelfAttention") {
            return failed;
        }
        let (q, k, v) = self.qkv(x);
        let y = if self.attn_dropout.is_active() {
            composite_attention(&q, &k, &v, Some(0), Some(&self.attn_dropout))
        } else {
            q.scaled_dot_product_attention_bthd(&k, &v, true, None)
        };
        self.output(&y)
    }
}

impl Module for CausalSelfAttention {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        self.c_attn.visit_params(&join(prefix, "c_attn"), f);
        self.c_proj.visit_params(&join(prefix, "c_proj"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        self.c_attn.visit_params_mut(&join(prefix, "c_attn"), f);
        self.c_proj.visit_params_mut(&join(prefix, "c_proj"), f);
    }

    fn set_training(&mut self, training: bool) {
        self.attn_dropout.set_training(training);
        self.resid_dropout.set_training(training);
    }
}

/// Multi-head attention with separate query, key, value and output
/// projections (`q_proj`, `k_proj`, `v_proj`, `out_proj`, each `E -> E`):
/// queries from one sequence attend over keys and values of another
/// (cross-attention) or of the same one.
#[derive(Clone, Debug)]
pub struct MultiHeadAttention {
    /// Queries, `E -> E`.
    pub q_proj: Linear,
    /// Keys, `E -> E`.
    pub k_proj: Linear,
    /// Values, `E -> E`.
    pub v_proj: Linear,
    /// The merged heads, `E -> E`.
    pub out_proj: Linear,
    /// The number of heads.
    pub n_head: usize,
}

impl MultiHeadAttention {
    /// A layer for `embed_dim` channels in `n_head` heads, with biases
    /// when `bias` is set.
    ///
    /// # Panics
    ///
    /// When `n_head` is 0 or does not divide `embed_dim`.
    pub fn new(
        embed_dim: usize,
        n_head: usize,
        bias: bool,
        rng: &mut Rng,
        device: &Device,
    ) -> MultiHeadAttention {
        assert!(
            n_head > 0 && embed_dim.is_multiple_of(n_head),
            "MultiHeadAttention: n_head ({n_head}) must divide embed_dim ({embed_dim})"
        );
        let mut proj = || Linear::new(embed_dim, embed_dim, bias, rng, device);
        MultiHeadAttention {
            q_proj: proj(),
            k_proj: proj(),
            v_proj: proj(),
            out_proj: proj(),
            n_head,
        }
    }

    /// Queries from `q_in: [B, T, E]` over keys and values from `kv_in:
    /// [B, S, E]`, giving `[B, T, E]`. With `causal`, query `i` sees keys
    /// `0..=i` (PyTorch's `is_causal` alignment).
    #[track_caller]
    pub fn forward(&self, q_in: &Tensor<f32>, kv_in: &Tensor<f32>, causal: bool) -> Tensor<f32> {
        let width = self.q_proj.in_features();
        for x in [q_in, kv_in] {
            if let Err(failed) = check_input(x, width, "MultiHeadAttention") {
                return failed;
            }
        }
        let q = split_heads(&self.q_proj.forward(q_in), self.n_head);
        let k = split_heads(&self.k_proj.forward(kv_in), self.n_head);
        let v = split_heads(&self.v_proj.forward(kv_in), self.n_head);
        let y = q.scaled_dot_product_attention_bthd(&k, &v, causal, None);
        self.out_proj.forward(&merge_heads(&y))
    }
}

impl Module for MultiHeadAttention {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        self.q_proj.visit_params(&join(prefix, "q_proj"), f);
        self.k_proj.visit_params(&join(prefix, "k_proj"), f);
        self.v_proj.visit_params(&join(prefix, "v_proj"), f);
        self.out_proj.visit_params(&join(prefix, "out_proj"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        self.q_proj.visit_params_mut(&join(prefix, "q_proj"), f);
        self.k_proj.visit_params_mut(&join(prefix, "k_proj"), f);
        self.v_proj.visit_params_mut(&join(prefix, "v_proj"), f);
        self.out_proj.visit_params_mut(&join(prefix, "out_proj"), f);
    }
}
