//! `stagecraft::nn`: every layer against hand-computed values or a
//! composite of plain ops, the initializers' statistics, parameter names
//! through nesting, weight tying's gradient, and safetensors round trips
//! and load errors.

use stagecraft::nn::{
    self, init, Activation, CausalSelfAttention, Conv2d, Dropout, Embedding, Forward, KvCache,
    LayerNorm, Linear, Module, ModuleExt, MultiHeadAttention, RmsNorm, Sequential,
};
use stagecraft::{Conv2dOptions, Device, ErrorKind, Rng, Tensor};
use std::collections::HashMap;

type T = Tensor<f32>;

fn cpu() -> Device {
    Device::cpu()
}

fn f32s(v: &[f32], dims: &[usize]) -> T {
    Tensor::from_vec(v.to_vec(), dims, &cpu()).unwrap()
}

fn close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "element {i}: {g} vs {w} ({got:?} vs {want:?})"
        );
    }
}

fn vals(t: &T) -> Vec<f32> {
    t.to_vec().unwrap()
}

fn names(m: &dyn Module) -> Vec<String> {
    let mut out = Vec::new();
    m.visit_params("", &mut |n, _| out.push(n.to_string()));
    out
}

/// A fresh copy that the tape does not know: a constant.
fn detached(t: &T) -> T {
    f32s(&vals(t), t.dims())
}

#[test]
fn linear_matches_hand_computed_values_over_any_leading_dims() {
    let w = f32s(&[1.0, 0.0, -1.0, 0.5, 0.5, 0.5], &[2, 3]);
    let b = f32s(&[1.0, -1.0], &[2]);
    let layer = Linear::from_params(w, Some(b));
    assert_eq!((layer.in_features(), layer.out_features()), (3, 2));
    let x = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let want = [-1.0, 2.0, -1.0, 6.5];
    assert_eq!(vals(&layer.forward(&x)), want);
    let y3 = layer.forward(&x.reshape(&[2, 1, 3]));
    assert_eq!(y3.dims(), &[2, 1, 2]);
    assert_eq!(vals(&y3), want);
    let y1 = layer.forward(&f32s(&[1.0, 2.0, 3.0], &[3]));
    assert_eq!(vals(&y1), [-1.0, 2.0]);
    let no_bias = Linear::from_params(layer.weight.clone(), None);
    assert_eq!(vals(&no_bias.forward(&x)), [-2.0, 3.0, -2.0, 7.5]);
    assert_eq!(names(&layer), ["weight", "bias"]);
    assert_eq!(names(&no_bias), ["weight"]);
}

#[test]
fn linear_gradients_match_an_explicit_transpose() {
    let mut rng = Rng::new(1);
    let layer = Linear::new(4, 3, true, &mut rng, &cpu());
    let x = init::normal(&[2, 5, 4], 0.0, 1.0, &mut rng, &cpu());
    let grads = |fused: bool| {
        let (w, b, x) = (
            detached(&layer.weight),
            detached(layer.bias.as_ref().unwrap()),
            detached(&x),
        );
        w.requires_grad();
        b.requires_grad();
        x.requires_grad();
        let y = if fused {
            x.linear(&w, Some(&b))
        } else {
            x.matmul(&w.transpose(0, 1)) + &b
        };
        let loss = (&y * &y).sum(&[], false);
        let g = loss.backward().unwrap();
        [&w, &b, &x].map(|t| vals(&g.get(t).unwrap()))
    };
    let (fused, plain) = (grads(true), grads(false));
    for (f, p) in fused.iter().zip(&plain) {
        close(f, p, 1e-5);
    }
}

#[test]
fn linear_init_is_pytorchs_default() {
    let layer = Linear::new(16, 300, true, &mut Rng::new(2), &cpu());
    assert_eq!(layer.weight.dims(), &[300, 16]);
    assert_eq!(layer.bias.as_ref().unwrap().dims(), &[300]);
    let w = vals(&layer.weight);
    assert!(w.iter().all(|v| v.abs() <= 0.25));
    // Uniform on ±1/4: variance 1/48.
    let var = w.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
    assert!((var - 1.0 / 48.0).abs() < 0.002, "{var}");
    assert_eq!(layer.num_params(), 300 * 16 + 300);
}

#[test]
fn embedding_picks_rows() {
    let table = f32s(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], &[3, 2]);
    let emb = Embedding::with_weight(table);
    let ids = Tensor::<i64>::from_vec(vec![2, 0, 1, 2], &[2, 2], &cpu()).unwrap();
    let rows = emb.forward_ids(&ids);
    assert_eq!(rows.dims(), &[2, 2, 2]);
    assert_eq!(vals(&rows), [4.0, 5.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let ids32 = Tensor::<i32>::from_vec(vec![1], &[1], &cpu()).unwrap();
    assert_eq!(vals(&emb.forward_ids(&ids32)), [2.0, 3.0]);
    assert_eq!(names(&emb), ["weight"]);
    let gpt = Embedding::with_std(1000, 10, 0.02, &mut Rng::new(3), &cpu());
    let w = vals(&gpt.weight);
    let std = (w.iter().map(|v| v * v).sum::<f32>() / w.len() as f32).sqrt();
    assert!((std - 0.02).abs() < 0.001, "{std}");
    let bad = Tensor::<i64>::from_vec(vec![3], &[1], &cpu()).unwrap();
    assert!(emb.forward_ids(&bad).to_vec().is_err());
}

#[test]
fn layer_norm_and_rms_norm_of_a_known_row() {
    let x = f32s(&[1.0, 2.0, 3.0, 4.0], &[1, 4]);
    let mut ln = LayerNorm::new(4, true, &cpu());
    ln.weight = Some(f32s(&[2.0; 4], &[4]));
    ln.bias = Some(f32s(&[1.0; 4], &[4]));
    // Mean 2.5, population variance 1.25.
    let inv = 1.0 / (1.25f64 + 1e-5).sqrt();
    let want: Vec<f32> = [1.0, 2.0, 3.0, 4.0]
        .iter()
        .map(|v| ((v - 2.5) * inv * 2.0 + 1.0) as f32)
        .collect();
    close(&vals(&ln.forward(&x)), &want, 1e-6);
    assert_eq!(names(&ln), ["weight", "bias"]);
    let plain = LayerNorm {
        weight: None,
        bias: None,
        eps: 0.0,
    };
    let want: Vec<f32> = [1.0, 2.0, 3.0, 4.0]
        .iter()
        .map(|v| ((v - 2.5) / 1.25f64.sqrt()) as f32)
        .collect();
    close(&vals(&plain.forward(&x)), &want, 1e-6);
    assert!(names(&plain).is_empty());
    assert_eq!(names(&LayerNorm::new(4, false, &cpu())), ["weight"]);

    let mut rms = RmsNorm::new(4, &cpu());
    rms.weight = Some(f32s(&[1.0, 2.0, 1.0, 2.0], &[4]));
    rms.eps = 0.0;
    // mean(x²) = 7.5.
    let r = 7.5f64.sqrt();
    let want = [1.0 / r, 4.0 / r, 3.0 / r, 8.0 / r].map(|v| v as f32);
    close(&vals(&rms.forward(&x)), &want, 1e-6);
    assert_eq!(names(&rms), ["weight"]);
}

#[test]
fn conv2d_tiny_case_and_shapes() {
    let x = f32s(
        &(1..=9).map(|v| v as f32).collect::<Vec<_>>(),
        &[1, 1, 3, 3],
    );
    let conv = Conv2d {
        weight: f32s(&[1.0; 4], &[1, 1, 2, 2]),
        bias: Some(f32s(&[0.5], &[1])),
        options: Conv2dOptions::default(),
    };
    let y = conv.forward(&x);
    assert_eq!(y.dims(), &[1, 1, 2, 2]);
    assert_eq!(vals(&y), [12.5, 16.5, 24.5, 28.5]);
    let strided = Conv2d {
        options: Conv2dOptions {
            stride: [2, 2],
            padding: [1, 1],
            ..Conv2dOptions::default()
        },
        ..conv.clone()
    };
    // Padded to 5×5, windows at (0,0), (0,2), (2,0), (2,2).
    assert_eq!(vals(&strided.forward(&x)), [1.5, 5.5, 11.5, 28.5]);
    let grouped = Conv2d::new(
        4,
        6,
        [3, 3],
        Conv2dOptions {
            groups: 2,
            padding: [1, 1],
            ..Conv2dOptions::default()
        },
        true,
        &mut Rng::new(4),
        &cpu(),
    );
    assert_eq!(grouped.weight.dims(), &[6, 2, 3, 3]);
    let bound = 1.0 / 18f32.sqrt();
    assert!(vals(&grouped.weight).iter().all(|v| v.abs() <= bound));
    let y = grouped.forward(&init::normal(
        &[2, 4, 5, 5],
        0.0,
        1.0,
        &mut Rng::new(5),
        &cpu(),
    ));
    assert_eq!(y.dims(), &[2, 6, 5, 5]);
    assert_eq!(names(&grouped), ["weight", "bias"]);
}

#[test]
fn dropout_is_the_identity_in_eval_and_reproducible_in_training() {
    let x = T::ones(&[1000], &cpu());
    let mut d = Dropout::new(0.5, Rng::new(9));
    assert!(d.is_training() && d.is_active());
    let a1 = vals(&d.forward(&x));
    let a2 = vals(&d.forward(&x));
    assert!(a1.iter().all(|&v| v == 0.0 || v == 2.0));
    let kept = a1.iter().filter(|&&v| v != 0.0).count();
    assert!((400..600).contains(&kept), "{kept}");
    assert_ne!(a1, a2, "each call draws a new mask");
    let same = Dropout::new(0.5, Rng::new(9));
    assert_eq!(vals(&same.forward(&x)), a1);
    assert_eq!(vals(&same.forward(&x)), a2);
    d.eval();
    assert!(!d.is_training() && !d.is_active());
    assert_eq!(vals(&d.forward(&x)), vec![1.0; 1000]);
    d.train();
    assert!(d.is_training());
    assert!(names(&d).is_empty());
}

#[test]
fn sequential_composes_layers_and_names_them_by_index() {
    let l1 = Linear::from_params(
        f32s(&[1.0, -1.0, -1.0, 1.0], &[2, 2]),
        Some(f32s(&[0.0, 1.0], &[2])),
    );
    let l2 = Linear::from_params(f32s(&[2.0, 3.0], &[1, 2]), None);
    let mut net = Sequential::new()
        .push(l1)
        .push(Activation::Relu)
        .push(Dropout::new(0.9, Rng::new(0)))
        .push(l2);
    assert_eq!(net.len(), 4);
    assert_eq!(names(&net), ["0.weight", "0.bias", "3.weight"]);
    net.eval();
    let x = f32s(&[3.0, 1.0, 1.0, 3.0], &[2, 2]);
    // Row 0: [2, -1] → relu [2, 0] → 4. Row 1: [-2, 3] → [0, 3] → 9.
    assert_eq!(vals(&net.forward(&x)), [4.0, 9.0]);
    let empty = Sequential::new();
    assert!(empty.is_empty());
    assert_eq!(vals(&empty.forward(&x)), vals(&x));
    let acts = [
        (Activation::Tanh, 0.0f32.tanh()),
        (Activation::Sigmoid, 0.5),
        (Activation::Silu, 0.0),
        (Activation::Gelu, 0.0),
        (Activation::GeluTanh, 0.0),
        (Activation::LeakyRelu(0.1), 0.0),
    ];
    for (act, want) in acts {
        assert_eq!(vals(&act.forward(&f32s(&[0.0], &[1]))), [want], "{act:?}");
    }
    assert_eq!(
        vals(&Activation::LeakyRelu(0.1).forward(&f32s(&[-2.0], &[1]))),
        [-0.2]
    );
}

/// nanoGPT's attention written with plain ops: an explicit transpose of
/// each weight, a host-built additive mask, softmax.
fn reference_attention(attn: &CausalSelfAttention, x: &T) -> T {
    let (b, t, c) = (x.dims()[0], x.dims()[1], x.dims()[2]);
    let h = attn.n_head;
    let d = c / h;
    let affine = |l: &Linear, x: &T| {
        let y = x.matmul(&l.weight.transpose(0, 1));
        match &l.bias {
            Some(bias) => y + bias,
            None => y,
        }
    };
    let qkv = affine(&attn.c_attn, x);
    let head = |i: usize| {
        qkv.narrow(2, i * c, c)
            .reshape(&[b, t, h, d])
            .permute(&[0, 2, 1, 3])
    };
    let (q, k, v) = (head(0), head(1), head(2));
    let mut mask = vec![0.0f32; t * t];
    for i in 0..t {
        for j in i + 1..t {
            mask[i * t + j] = f32::NEG_INFINITY;
        }
    }
    let scale = f32s(&[1.0 / (d as f32).sqrt()], &[]);
    let scores = &q.matmul(&k.transpose(2, 3)) * &scale + f32s(&mask, &[t, t]);
    let y = scores.softmax(-1).matmul(&v);
    let y = y.permute(&[0, 2, 1, 3]).reshape(&[b, t, c]);
    affine(&attn.c_proj, &y)
}

#[test]
fn causal_self_attention_matches_the_composite() {
    for bias in [true, false] {
        let mut rng = Rng::new(10);
        let attn = CausalSelfAttention::new(8, 2, bias, 0.0, &mut rng, &cpu());
        let x = init::normal(&[2, 5, 8], 0.0, 1.0, &mut rng, &cpu());
        let y = attn.forward(&x);
        assert_eq!(y.dims(), &[2, 5, 8]);
        close(&vals(&y), &vals(&reference_attention(&attn, &x)), 1e-5);
        let want: &[&str] = if bias {
            &[
                "c_attn.weight",
                "c_attn.bias",
                "c_proj.weight",
                "c_proj.bias",
            ]
        } else {
            &["c_attn.weight", "c_proj.weight"]
        };
        assert_eq!(names(&attn), want);
        assert_eq!(attn.c_attn.weight.dims(), &[24, 8]);
    }
}

#[test]
fn cached_attention_equals_uncached() {
    let mut rng = Rng::new(11);
    let mut attn = CausalSelfAttention::new(12, 3, true, 0.1, &mut rng, &cpu());
    attn.eval();
    let x = init::normal(&[2, 9, 12], 0.0, 1.0, &mut rng, &cpu());
    let full = vals(&attn.forward(&x));
    let mut cache = KvCache::new();
    assert!(cache.is_empty());
    // An empty cache (causal), one new position (no mask), several new
    // positions after cached ones (the end-aligned mask), one again.
    let mut pieces = Vec::new();
    for (start, len) in [(0, 3), (3, 1), (4, 4), (8, 1)] {
        pieces.push(attn.forward_cached(&x.narrow(1, start, len), &mut cache));
        assert_eq!(cache.len(), start + len);
    }
    let refs: Vec<&T> = pieces.iter().collect();
    let cached = vals(&Tensor::concat(&refs, 1));
    close(&cached, &full, 1e-5);
    assert_eq!(cache.k.as_ref().unwrap().dims(), &[2, 9, 3, 4]);
    cache.clear();
    assert!(cache.is_empty());
}

#[test]
fn attention_dropout_runs_only_in_training_and_reproducibly() {
    let make = || CausalSelfAttention::new(8, 2, true, 0.5, &mut Rng::new(12), &cpu());
    let x = init::normal(&[1, 6, 8], 0.0, 1.0, &mut Rng::new(13), &cpu());
    let (mut a, b) = (make(), make());
    let train = vals(&a.forward(&x));
    assert_eq!(train, vals(&b.forward(&x)), "same seed, same masks");
    a.eval();
    let eval = vals(&a.forward(&x));
    assert_ne!(train, eval);
    close(&eval, &vals(&reference_attention(&a, &x)), 1e-5);
    // In training the cached path drops out too, with the same masks as
    // the uncached one when fed the whole sequence at once.
    let c = make();
    let cached = vals(&c.forward_cached(&x, &mut KvCache::new()));
    assert_eq!(cached, train);
}

#[test]
fn multi_head_attention_matches_the_composite() {
    let mut rng = Rng::new(14);
    let mha = MultiHeadAttention::new(8, 2, true, &mut rng, &cpu());
    assert_eq!(
        names(&mha),
        [
            "q_proj.weight",
            "q_proj.bias",
            "k_proj.weight",
            "k_proj.bias",
            "v_proj.weight",
            "v_proj.bias",
            "out_proj.weight",
            "out_proj.bias"
        ]
    );
    let q_in = init::normal(&[2, 3, 8], 0.0, 1.0, &mut rng, &cpu());
    let kv_in = init::normal(&[2, 5, 8], 0.0, 1.0, &mut rng, &cpu());
    let y = mha.forward(&q_in, &kv_in, false);
    assert_eq!(y.dims(), &[2, 3, 8]);
    let split = |l: &Linear, x: &T| {
        let t = x.dims()[1];
        x.linear(&l.weight, l.bias.as_ref())
            .reshape(&[2, t, 2, 4])
            .permute(&[0, 2, 1, 3])
    };
    let (q, k, v) = (
        split(&mha.q_proj, &q_in),
        split(&mha.k_proj, &kv_in),
        split(&mha.v_proj, &kv_in),
    );
    let scale = f32s(&[0.5], &[]);
    let o = (&q.matmul(&k.transpose(2, 3)) * &scale)
        .softmax(-1)
        .matmul(&v);
    let o = o.permute(&[0, 2, 1, 3]).reshape(&[2, 3, 8]);
    let want = o.linear(&mha.out_proj.weight, mha.out_proj.bias.as_ref());
    close(&vals(&y), &vals(&want), 1e-5);
    let causal = mha.forward(&q_in, &q_in, true);
    assert_eq!(causal.dims(), &[2, 3, 8]);
}

fn mean_std(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

#[test]
fn initializers_have_their_statistics_and_are_seeded() {
    let d = cpu();
    let n = [100, 100];
    let check = |t: T, mean: f64, std: f64, bound: Option<f64>| {
        let v = vals(&t);
        assert_eq!(v.len(), 10_000);
        let (m, s) = mean_std(&v);
        assert!(
            (m - mean).abs() < 0.03 * std.max(1e-3) * 2.0 + 1e-9,
            "mean {m} vs {mean}"
        );
        assert!((s - std).abs() < 0.03 * std, "std {s} vs {std}");
        if let Some(b) = bound {
            assert!(v.iter().all(|&x| (x as f64).abs() <= b), "beyond ±{b}");
        }
    };
    check(
        init::normal(&n, 1.5, 2.0, &mut Rng::new(1), &d),
        1.5,
        2.0,
        None,
    );
    let u = init::uniform(&n, -1.0, 3.0, &mut Rng::new(2), &d);
    assert!(vals(&u).iter().all(|&x| (-1.0..3.0).contains(&x)));
    check(u, 1.0, 4.0 / 12f64.sqrt(), None);
    let fan_in = 50;
    let he = (2.0 / fan_in as f64).sqrt();
    check(
        init::kaiming_uniform(&n, fan_in, &mut Rng::new(3), &d),
        0.0,
        he,
        Some(he * 3f64.sqrt()),
    );
    check(
        init::kaiming_normal(&n, fan_in, &mut Rng::new(4), &d),
        0.0,
        he,
        None,
    );
    let glorot = (2.0 / 150.0f64).sqrt();
    check(
        init::xavier_uniform(&n, 50, 100, &mut Rng::new(5), &d),
        0.0,
        glorot,
        Some((6.0 / 150.0f64).sqrt()),
    );
    check(
        init::xavier_normal(&n, 50, 100, &mut Rng::new(6), &d),
        0.0,
        glorot,
        None,
    );

    let a = vals(&init::normal(&[64], 0.0, 1.0, &mut Rng::new(7), &d));
    let b = vals(&init::normal(&[64], 0.0, 1.0, &mut Rng::new(7), &d));
    let c = vals(&init::normal(&[64], 0.0, 1.0, &mut Rng::new(8), &d));
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!(init::fans(&[300, 16]), (16, 300));
    assert_eq!(init::fans(&[6, 2, 3, 3]), (18, 54));
    assert_eq!(init::fans(&[7]), (7, 7));
}

#[test]
fn rng_forks_are_distinct_and_reproducible() {
    let mut r1 = Rng::new(5);
    let mut r2 = Rng::new(5);
    let (f1, g1) = (r1.fork(), r1.fork());
    assert_eq!(f1, r2.fork());
    assert_ne!(f1, g1);
    assert_ne!(f1.seed(), 5);
}

/// A transformer block and model in nanoGPT's shape, to check names
/// through nesting and mode switching through every level.
struct Block {
    ln_1: LayerNorm,
    attn: CausalSelfAttention,
    mlp: Sequential,
}

impl Module for Block {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &T)) {
        self.ln_1.visit_params(&nn::join(prefix, "ln_1"), f);
        self.attn.visit_params(&nn::join(prefix, "attn"), f);
        self.mlp.visit_params(&nn::join(prefix, "mlp"), f);
    }
    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut T)) {
        self.ln_1.visit_params_mut(&nn::join(prefix, "ln_1"), f);
        self.attn.visit_params_mut(&nn::join(prefix, "attn"), f);
        self.mlp.visit_params_mut(&nn::join(prefix, "mlp"), f);
    }
    fn set_training(&mut self, training: bool) {
        self.attn.set_training(training);
        self.mlp.set_training(training);
    }
}

impl Forward for Block {
    fn forward(&self, x: &T) -> T {
        let x = x + &self.attn.forward(&self.ln_1.forward(x));
        &x + &self.mlp.forward(&x)
    }
}

struct Gpt {
    wte: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
}

impl Gpt {
    fn new(seed: u64) -> Gpt {
        let (d, mut rng) = (cpu(), Rng::new(seed));
        let blocks = (0..2)
            .map(|_| Block {
                ln_1: LayerNorm::new(8, true, &d),
                attn: CausalSelfAttention::new(8, 2, true, 0.1, &mut rng, &d),
                mlp: Sequential::new()
                    .push(Linear::new(8, 32, true, &mut rng, &d))
                    .push(Activation::GeluTanh)
                    .push(Linear::new(32, 8, true, &mut rng, &d))
                    .push(Dropout::new(0.1, rng.fork())),
            })
            .collect();
        Gpt {
            wte: Embedding::with_std(11, 8, 0.02, &mut rng, &d),
            blocks,
            ln_f: LayerNorm::new(8, false, &d),
        }
    }

    /// Logits through the tied head: `wte.weight` is both the embedding
    /// table and the output projection.
    fn logits(&self, ids: &Tensor<i64>) -> T {
        let mut h = self.wte.forward_ids(ids);
        for block in &self.blocks {
            h = block.forward(&h);
        }
        self.ln_f.forward(&h).linear(&self.wte.weight, None)
    }
}

impl Module for Gpt {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &T)) {
        self.wte.visit_params(&nn::join(prefix, "wte"), f);
        for (i, b) in self.blocks.iter().enumerate() {
            b.visit_params(&nn::join(prefix, &format!("blocks.{i}")), f);
        }
        self.ln_f.visit_params(&nn::join(prefix, "ln_f"), f);
    }
    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut T)) {
        self.wte.visit_params_mut(&nn::join(prefix, "wte"), f);
        for (i, b) in self.blocks.iter_mut().enumerate() {
            b.visit_params_mut(&nn::join(prefix, &format!("blocks.{i}")), f);
        }
        self.ln_f.visit_params_mut(&nn::join(prefix, "ln_f"), f);
    }
    fn set_training(&mut self, training: bool) {
        for b in &mut self.blocks {
            b.set_training(training);
        }
    }
}

fn ids(v: &[i64], dims: &[usize]) -> Tensor<i64> {
    Tensor::from_vec(v.to_vec(), dims, &cpu()).unwrap()
}

#[test]
fn parameter_names_follow_the_nesting() {
    let gpt = Gpt::new(20);
    let all = names(&gpt);
    assert_eq!(all.len(), 1 + 2 * 10 + 1);
    assert_eq!(all[0], "wte.weight");
    for want in [
        "blocks.0.ln_1.weight",
        "blocks.0.attn.c_attn.weight",
        "blocks.1.attn.c_proj.bias",
        "blocks.1.mlp.0.weight",
        "blocks.1.mlp.2.bias",
        "ln_f.weight",
    ] {
        assert!(all.iter().any(|n| n == want), "{want} not in {all:?}");
    }
    assert!(!all.iter().any(|n| n.contains("lm_head")));
    let named = gpt.named_params();
    assert_eq!(named.len(), all.len());
    let expected: usize = 11 * 8 + 2 * (16 + 24 * 8 + 24 + 64 + 8 + 8 * 32 + 32 + 32 * 8 + 8) + 8;
    assert_eq!(gpt.num_params(), expected);
}

#[test]
fn train_and_eval_reach_every_dropout() {
    let mut gpt = Gpt::new(21);
    let x = ids(&[1, 2, 3, 4, 5, 6], &[1, 6]);
    gpt.eval();
    let e1 = vals(&gpt.logits(&x));
    assert_eq!(e1, vals(&gpt.logits(&x)), "eval is deterministic");
    gpt.train();
    assert_ne!(vals(&gpt.logits(&x)), e1);
    gpt.eval();
    assert_eq!(vals(&gpt.logits(&x)), e1);
}

#[test]
fn a_tied_weight_is_visited_once_and_gets_the_sum_of_both_gradients() {
    let mut gpt = Gpt::new(22);
    gpt.eval();
    let x = ids(&[1, 7, 7, 3, 0, 10], &[2, 3]);
    let targets = ids(&[7, 7, 3, 0, 10, 2], &[2, 3]);
    let loss_of = |gpt: &Gpt| gpt.logits(&x).cross_entropy(&targets, Default::default());
    assert_eq!(
        names(&gpt).iter().filter(|n| n.starts_with("wte")).count(),
        1
    );

    gpt.requires_grad();
    let tied = loss_of(&gpt).backward().unwrap();
    let tied = vals(&tied.get(&gpt.wte.weight).unwrap());

    // Each use alone: the other one reads a constant copy of the table.
    let table = gpt.wte.weight.clone();
    let constant = detached(&table);
    let one_use = |gpt: &Gpt, head: &T, embedding: &T, tracked: &T| {
        tracked.requires_grad();
        let mut h = embedding.embedding(&x);
        for block in &gpt.blocks {
            h = block.forward(&h);
        }
        let loss = gpt
            .ln_f
            .forward(&h)
            .linear(head, None)
            .cross_entropy(&targets, Default::default());
        vals(&loss.backward().unwrap().get(tracked).unwrap())
    };
    let via_embedding = one_use(&gpt, &constant, &table, &table);
    let via_head = one_use(&gpt, &table, &constant, &table);
    let sum: Vec<f32> = via_embedding
        .iter()
        .zip(&via_head)
        .map(|(a, b)| a + b)
        .collect();
    close(&tied, &sum, 1e-5);
    assert!(via_embedding.iter().any(|&g| g != 0.0) && via_head.iter().any(|&g| g != 0.0));
}

/// Removes the directory of a [`temp_path`], and the process's directory
/// once no other test uses it: tests run at once, and one removing the
/// shared directory while another writes in it failed that one.
fn remove_temp(path: &std::path::Path) {
    let own = path.parent().unwrap();
    let _ = std::fs::remove_dir_all(own);
    let _ = std::fs::remove_dir(own.parent().unwrap());
}

fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir()
        .join(format!("stagecraft-nn-{}", std::process::id()))
        .join(name)
}

fn param_values(m: &dyn Module) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out = Vec::new();
    m.visit_params("", &mut |n, t| {
        out.push((n.to_string(), t.dims().to_vec(), vals(t)))
    });
    out
}

#[test]
fn save_then_load_restores_parameters_and_outputs() {
    let mut source = Gpt::new(30);
    let mut target = Gpt::new(31);
    source.eval();
    target.eval();
    let x = ids(&[4, 2, 9, 1], &[1, 4]);
    assert_ne!(param_values(&source), param_values(&target));
    let path = temp_path("round_trip/model.safetensors");
    nn::save(&source, &path).unwrap();
    nn::load(&mut target, &path).unwrap();
    assert_eq!(param_values(&source), param_values(&target));
    assert_eq!(vals(&source.logits(&x)), vals(&target.logits(&x)));

    let meta = HashMap::from([("model".to_string(), "gpt".to_string())]);
    nn::save_with_metadata(&source, &path, &meta).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(nn::read_metadata(&bytes).unwrap(), meta);
    let plain = nn::save_to_bytes(&source, &HashMap::new()).unwrap();
    assert!(nn::read_metadata(&plain).unwrap().is_empty());
    let mut third = Gpt::new(32);
    nn::load_from_bytes(&mut third, &plain, "memory").unwrap();
    assert_eq!(param_values(&source), param_values(&third));
    remove_temp(&path);
}

/// A safetensors file holding the given raw tensors.
fn file_with(tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, dt, dims, data)| {
            (
                *n,
                safetensors::tensor::TensorView::new(*dt, dims.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

fn f32_bytes(n: usize) -> Vec<u8> {
    (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect()
}

#[test]
fn load_errors_name_the_key_and_leave_the_module_unchanged() {
    use safetensors::Dtype;
    let mut layer = Linear::new(3, 2, true, &mut Rng::new(40), &cpu());
    let before = param_values(&layer);
    let mut expect_err = |bytes: &[u8], kind: ErrorKind, parts: &[&str]| {
        let err = nn::load_from_bytes(&mut layer, bytes, "ckpt.safetensors").unwrap_err();
        assert_eq!(err.kind(), kind, "{err}");
        let msg = err.to_string();
        assert!(msg.contains("ckpt.safetensors"), "{msg}");
        for part in parts {
            assert!(msg.contains(part), "{part:?} not in {msg}");
        }
        assert_eq!(param_values(&layer), before);
    };
    let weight = ("weight", Dtype::F32, vec![2, 3], f32_bytes(6));
    let bias = ("bias", Dtype::F32, vec![2], f32_bytes(2));

    let missing = file_with(std::slice::from_ref(&weight));
    expect_err(&missing, ErrorKind::InvalidArgument, &["missing", "bias"]);

    let extra = file_with(&[
        weight.clone(),
        bias.clone(),
        ("lm_head.weight", Dtype::F32, vec![1], f32_bytes(1)),
        ("extra", Dtype::F32, vec![1], f32_bytes(1)),
    ]);
    expect_err(
        &extra,
        ErrorKind::InvalidArgument,
        &["unexpected", "lm_head.weight", "extra"],
    );

    let shape = file_with(&[
        ("weight", Dtype::F32, vec![3, 2], f32_bytes(6)),
        bias.clone(),
    ]);
    expect_err(&shape, ErrorKind::Shape, &["weight", "[3, 2]", "[2, 3]"]);

    let dtype = file_with(&[weight.clone(), ("bias", Dtype::F64, vec![2], vec![0; 16])]);
    expect_err(&dtype, ErrorKind::DType, &["bias", "F64", "F32"]);

    expect_err(
        b"not a safetensors file at all",
        ErrorKind::InvalidArgument,
        &["not a safetensors file"],
    );
    let good = file_with(&[weight, bias]);
    expect_err(
        &good[..good.len() - 3],
        ErrorKind::InvalidArgument,
        &["not a safetensors file"],
    );
    expect_err(
        &good[..5],
        ErrorKind::InvalidArgument,
        &["not a safetensors file"],
    );

    nn::load_from_bytes(&mut layer, &good, "ckpt.safetensors").unwrap();
    assert_eq!(vals(&layer.weight), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);

    let missing_file = temp_path("no/such/file.safetensors");
    let err = nn::load(&mut layer, &missing_file).unwrap_err().to_string();
    assert!(err.contains("file.safetensors"), "{err}");
    let path = temp_path("errors/missing.safetensors");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, &missing).unwrap();
    let err = nn::load(&mut layer, &path).unwrap_err().to_string();
    assert!(
        err.contains("missing.safetensors") && err.contains("bias"),
        "{err}"
    );
    remove_temp(&path);
}

#[test]
fn attention_layers_refuse_inputs_of_the_wrong_shape_at_the_callers_line() {
    let d = cpu();
    let mut rng = Rng::new(5);
    let attn = CausalSelfAttention::new(8, 2, false, 0.0, &mut rng, &d);
    let mha = MultiHeadAttention::new(8, 2, true, &mut rng, &d);
    let rank2 = Tensor::<f32>::ones(&[4, 8], &d);
    let narrow = Tensor::<f32>::ones(&[1, 4, 6], &d);
    let good = Tensor::<f32>::ones(&[1, 4, 8], &d);
    let cases: Vec<(T, &str, u32)> = vec![
        (attn.forward(&rank2), "CausalSelfAttention", line!()),
        (attn.forward(&narrow), "CausalSelfAttention", line!()),
        (
            attn.forward_cached(&rank2, &mut KvCache::new()),
            "CausalSelfAttention",
            line!() - 2,
        ),
        (
            mha.forward(&good, &rank2, false),
            "MultiHeadAttention",
            line!() - 2,
        ),
    ];
    for (out, op, line) in cases {
        let err = out.to_vec().unwrap_err();
        assert_eq!(err.op(), Some(op), "{err}");
        assert_eq!(err.kind(), ErrorKind::Shape, "{err}");
        assert_eq!(err.location().map(|l| l.line()), Some(line), "{err}");
    }
    // A failed input passes its own error on.
    let failed = Tensor::<f32>::ones(&[2, 3], &d).reshape(&[5]);
    let err = attn.forward(&failed).to_vec().unwrap_err();
    assert_eq!(err.op(), Some("Reshape"), "{err}");
}
