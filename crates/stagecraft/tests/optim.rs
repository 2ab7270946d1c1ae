//! `stagecraft::optim`: each optimizer against a plain f32 reference over
//! ten steps, parameter groups, bad input, an end-to-end regression eager
//! and lazy, and the lazy trace cache under a changing learning rate.
//!
//! Tests that use the lazy device run one at a time: its metrics are
//! process-wide.

use stagecraft::nn::{join, Module, ModuleExt};
use stagecraft::optim::{
    Adam, AdamConfig, AdamW, Cosine, GroupOptions, LrSchedule, Optimizer, Sgd, SgdConfig,
};
use stagecraft::{lazy, Device, Gradients, Tensor};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `w: [2, 3]` and `b: [3]` under `prefix`.
struct Affine {
    prefix: &'static str,
    w: Tensor<f32>,
    b: Tensor<f32>,
}

impl Module for Affine {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        let prefix = join(prefix, self.prefix);
        f(&join(&prefix, "w"), &self.w);
        f(&join(&prefix, "b"), &self.b);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        let prefix = join(prefix, self.prefix);
        f(&join(&prefix, "w"), &mut self.w);
        f(&join(&prefix, "b"), &mut self.b);
    }
}

const W0: [f32; 6] = [0.5, -1.25, 2.0, 0.125, -0.75, 1.5];
const B0: [f32; 3] = [0.25, -0.5, 1.0];

fn affine(device: &Device) -> Affine {
    Affine {
        prefix: "layer",
        w: Tensor::from_vec(W0.to_vec(), &[2, 3], device).unwrap(),
        b: Tensor::from_vec(B0.to_vec(), &[3], device).unwrap(),
    }
}

/// A fixed gradient for element `i` of a parameter at `step`, varied in
/// sign and magnitude.
fn grad_value(param: usize, i: usize, step: usize) -> f32 {
    let x = (i as f64 * 1.37 + step as f64 * 0.71 + param as f64 * 2.3).sin();
    (x * (1.0 + step as f64 * 0.3)) as f32
}

fn grad_values(param: usize, n: usize, step: usize) -> Vec<f32> {
    (0..n).map(|i| grad_value(param, i, step)).collect()
}

/// The gradients of step `step`, set by hand on the model's parameters.
fn grads_for(model: &Affine, step: usize) -> Gradients {
    let device = model.w.device();
    let mut grads = Gradients::default();
    let gw = Tensor::from_vec(grad_values(0, 6, step), &[2, 3], &device).unwrap();
    let gb = Tensor::from_vec(grad_values(1, 3, step), &[3], &device).unwrap();
    grads.insert(&model.w, gw);
    grads.insert(&model.b, gb);
    grads
}

/// The learning rate of step `step`: changes every step.
fn lr_at(step: usize) -> f64 {
    0.05 / (1.0 + 0.37 * step as f64)
}

fn assert_ulps(got: &[f32], want: &[f32], ulps: i64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let d = (a.to_bits() as i64 - b.to_bits() as i64).abs();
        assert!(d <= ulps, "{what}[{i}]: got {a}, reference {b} ({d} ulps)");
    }
}

/// Runs `opt` for ten steps on the hand-set gradients and compares each
/// parameter after every step with `reference(param_index, p, g, lr, t)`,
/// which updates one parameter's plain f32 copy in place.
fn check_against_reference(
    device: &Device,
    opt: &mut dyn Optimizer,
    mut reference: impl FnMut(usize, &mut [f32], &[f32], f64, u64),
    what: &str,
) {
    let mut model = affine(device);
    let mut want = [W0.to_vec(), B0.to_vec()];
    for step in 0..10 {
        let lr = lr_at(step);
        opt.set_lr(lr);
        let grads = grads_for(&model, step);
        opt.step(&mut model, &grads).unwrap();
        assert_eq!(opt.step_count(), step as u64 + 1);
        for (k, p) in want.iter_mut().enumerate() {
            let g = grad_values(k, p.len(), step);
            reference(k, p, &g, lr, step as u64 + 1);
        }
        let what = format!("{what}, step {step}");
        assert_ulps(
            &model.w.to_vec().unwrap(),
            &want[0],
            1,
            &format!("{what}, w"),
        );
        assert_ulps(
            &model.b.to_vec().unwrap(),
            &want[1],
            1,
            &format!("{what}, b"),
        );
    }
}

/// `torch.optim.SGD`'s update, element by element, in f32.
fn sgd_reference(config: SgdConfig) -> impl FnMut(usize, &mut [f32], &[f32], f64, u64) {
    let mut velocity: [Vec<f32>; 2] = [vec![0.0; 6], vec![0.0; 3]];
    move |k, p, g, lr, t| {
        let lr = lr as f32;
        let m = config.momentum as f32;
        let share = if t == 1 {
            1.0
        } else {
            (1.0 - config.dampening) as f32
        };
        for i in 0..p.len() {
            let mut d = g[i] + p[i] * config.weight_decay as f32;
            if config.momentum != 0.0 {
                let v = &mut velocity[k][i];
                // The paper's first step, v = g, written out.
                *v = if t == 1 { d } else { *v * m + d * share };
                d = if config.nesterov { d + *v * m } else { *v };
            }
            p[i] -= d * lr;
        }
    }
}

#[test]
fn sgd_matches_reference() {
    let configs = [
        SgdConfig::default(),
        SgdConfig {
            momentum: 0.9,
            ..SgdConfig::default()
        },
        SgdConfig {
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.01,
            ..SgdConfig::default()
        },
        SgdConfig {
            momentum: 0.8,
            dampening: 0.3,
            weight_decay: 0.05,
            ..SgdConfig::default()
        },
    ];
    for config in configs {
        let mut opt = Sgd::new(config);
        let what = format!("{config:?}");
        check_against_reference(&Device::cpu(), &mut opt, sgd_reference(config), &what);
    }
}

/// Adam's update in f32, in the optimizer's operation order: `m̂ = m/bc1`,
/// `v̂ = v/bc2`, `p' = p·(1 - lr·wd)` (AdamW) and `p' - lr·m̂/(√v̂ + ε)`,
/// with the per-step values computed in f64 and rounded once.
fn adam_reference(
    config: AdamConfig,
    decoupled: bool,
    decay: [f64; 2],
) -> impl FnMut(usize, &mut [f32], &[f32], f64, u64) {
    let mut moments: [(Vec<f32>, Vec<f32>); 2] =
        [(vec![0.0; 6], vec![0.0; 6]), (vec![0.0; 3], vec![0.0; 3])];
    move |k, p, g, lr, t| {
        let (b1, b2) = config.betas;
        let wd = decay[k];
        let bc1 = (1.0 - b1.powi(t as i32)) as f32;
        let bc2 = (1.0 - b2.powi(t as i32)) as f32;
        let shrink = (1.0 - lr * wd) as f32;
        let (m, v) = &mut moments[k];
        for i in 0..p.len() {
            let g = if decoupled {
                g[i]
            } else {
                g[i] + p[i] * wd as f32
            };
            m[i] = m[i] * b1 as f32 + g * (1.0 - b1) as f32;
            v[i] = v[i] * b2 as f32 + (g * g) * (1.0 - b2) as f32;
            let direction = (m[i] / bc1) / ((v[i] / bc2).sqrt() + config.eps as f32);
            let base = if decoupled && wd != 0.0 {
                p[i] * shrink
            } else {
                p[i]
            };
            p[i] = base - direction * lr as f32;
        }
    }
}

#[test]
fn adam_matches_reference() {
    let config = AdamConfig {
        betas: (0.85, 0.99),
        weight_decay: 0.02,
        ..AdamConfig::default()
    };
    let mut opt = Adam::new(config);
    let reference = adam_reference(config, false, [0.02, 0.02]);
    check_against_reference(&Device::cpu(), &mut opt, reference, "Adam");
}

#[test]
fn adamw_matches_reference_eager_and_lazy() {
    let _g = serial();
    let config = AdamConfig {
        weight_decay: 0.1,
        ..AdamConfig::default()
    };
    for device in [Device::cpu(), Device::lazy(&Device::cpu())] {
        let mut opt = AdamW::new(config);
        // The default groups: `b` (1-D) is not decayed.
        let reference = adam_reference(config, true, [0.1, 0.0]);
        check_against_reference(&device, &mut opt, reference, &format!("AdamW on {device}"));
    }
}

#[test]
fn default_adamw_decays_matrices_only_and_groups_override() {
    let config = AdamConfig {
        lr: 0.1,
        weight_decay: 0.5,
        ..AdamConfig::default()
    };
    // Zero gradients: Adam's own step is exactly 0, leaving only decay.
    let zero_grads = |model: &Affine| {
        let mut grads = Gradients::default();
        grads.insert(&model.w, Tensor::zeros(&[2, 3], &Device::cpu()));
        grads.insert(&model.b, Tensor::zeros(&[3], &Device::cpu()));
        grads
    };
    let mut model = affine(&Device::cpu());
    let mut opt = AdamW::new(config);
    for _ in 0..3 {
        let grads = zero_grads(&model);
        opt.step(&mut model, &grads).unwrap();
    }
    assert_eq!(model.b.to_vec().unwrap(), B0, "1-D parameter decayed");
    let shrink = (1.0 - 0.1 * 0.5f64) as f32;
    let want: Vec<f32> = W0.iter().map(|w| w * shrink * shrink * shrink).collect();
    assert_eq!(model.w.to_vec().unwrap(), want);

    // Custom groups: decay everything under `layer.b`, freeze `layer.w`
    // with a zero learning-rate scale.
    let mut model = affine(&Device::cpu());
    let mut opt = AdamW::with_groups(config, |name, _| GroupOptions {
        lr_scale: if name == "layer.w" { 0.0 } else { 1.0 },
        weight_decay: 0.5,
    });
    let grads = zero_grads(&model);
    opt.step(&mut model, &grads).unwrap();
    assert_eq!(model.w.to_vec().unwrap(), W0);
    let want: Vec<f32> = B0.iter().map(|b| b * shrink).collect();
    assert_eq!(model.b.to_vec().unwrap(), want);
}

#[test]
fn parameters_without_gradients_are_left_alone() {
    let mut model = affine(&Device::cpu());
    let mut grads = Gradients::default();
    let g = Tensor::full(&[2, 3], 1.0, &Device::cpu());
    grads.insert(&model.w, g);
    let mut opt = Sgd::new(SgdConfig {
        lr: 0.5,
        momentum: 0.9,
        weight_decay: 0.1,
        ..SgdConfig::default()
    });
    opt.step(&mut model, &grads).unwrap();
    assert_eq!(model.b.to_vec().unwrap(), B0);
    assert_ne!(model.w.to_vec().unwrap(), W0);
    // A step with no gradients at all still counts.
    opt.step(&mut model, &Gradients::default()).unwrap();
    assert_eq!(opt.step_count(), 2);
}

#[test]
fn a_gradient_of_the_wrong_shape_is_an_error_naming_the_parameter() {
    let mut model = affine(&Device::cpu());
    let mut grads = Gradients::default();
    grads.insert(&model.w, Tensor::ones(&[2, 3], &Device::cpu()));
    grads.insert(&model.b, Tensor::ones(&[4], &Device::cpu()));
    let mut opt = AdamW::new(AdamConfig::default());
    let err = opt.step(&mut model, &grads).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("`layer.b`"), "{message}");
    assert!(
        message.contains("[4]") && message.contains("[3]"),
        "{message}"
    );
    // Nothing moved, not even the parameter before the bad one.
    assert_eq!(model.w.to_vec().unwrap(), W0);
    assert_eq!(opt.step_count(), 0);

    // A parameter whose shape changed since its state was made.
    let mut opt = Adam::new(AdamConfig::default());
    let grads = grads_for(&model, 0);
    opt.step(&mut model, &grads).unwrap();
    model.w = Tensor::ones(&[3, 2], &Device::cpu());
    let mut grads = Gradients::default();
    grads.insert(&model.w, Tensor::ones(&[3, 2], &Device::cpu()));
    let message = opt.step(&mut model, &grads).unwrap_err().to_string();
    assert!(message.contains("`layer.w`"), "{message}");

    let mut bad = Sgd::new(SgdConfig {
        nesterov: true,
        ..SgdConfig::default()
    });
    let grads = grads_for(&model, 0);
    assert!(
        bad.step(&mut model, &grads).is_err(),
        "Nesterov without momentum"
    );
    let mut bad = Adam::new(AdamConfig {
        betas: (1.0, 0.999),
        ..AdamConfig::default()
    });
    assert!(bad.step(&mut model, &grads).is_err(), "beta1 = 1");
}

/// A linear regression `x·w + b ≈ y` with `x: [8, 3]`, `w: [3, 2]`.
struct Regression {
    w: Tensor<f32>,
    b: Tensor<f32>,
}

impl Module for Regression {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        f(&join(prefix, "w"), &self.w);
        f(&join(prefix, "b"), &self.b);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        f(&join(prefix, "w"), &mut self.w);
        f(&join(prefix, "b"), &mut self.b);
    }
}

/// Trains the regression with AdamW under a cosine schedule, calling
/// `lazy::mark_step` after each step, and returns the losses and the
/// number of traces compiled during the loop.
fn train(device: &Device, steps: u64) -> (Vec<f32>, u64) {
    let x: Vec<f32> = (0..24).map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0).collect();
    let true_w = [1.5f32, -2.0, 0.5, 1.0, -0.25, 3.0];
    let mut y = Vec::new();
    for r in 0..8 {
        for c in 0..2 {
            y.push(
                (0..3)
                    .map(|k| x[r * 3 + k] * true_w[k * 2 + c])
                    .sum::<f32>()
                    + 0.5,
            );
        }
    }
    let x = Tensor::from_vec(x, &[8, 3], device).unwrap();
    let y = Tensor::from_vec(y, &[8, 2], device).unwrap();
    let mut model = Regression {
        w: Tensor::full(&[3, 2], 0.1, device),
        b: Tensor::zeros(&[2], device),
    };
    let mut opt = AdamW::new(AdamConfig {
        lr: 0.2,
        weight_decay: 0.01,
        ..AdamConfig::default()
    });
    let schedule = Cosine {
        max_lr: 0.2,
        min_lr: 0.02,
        warmup: 2,
        total: steps,
    };
    lazy::mark_step();
    let before = lazy::metrics().traces_compiled;
    let mut losses = Vec::new();
    for _ in 0..steps {
        model.requires_grad();
        let d = x.matmul(&model.w) + &model.b - &y;
        let loss = (&d * &d).mean(&[0, 1], false);
        let grads = loss.backward().unwrap();
        opt.step_scheduled(&schedule, &mut model, &grads).unwrap();
        lazy::mark_step();
        losses.push(loss);
    }
    let compiled = lazy::metrics().traces_compiled - before;
    let losses = losses.iter().map(|l| l.item().unwrap()).collect();
    (losses, compiled)
}

#[test]
fn training_reduces_the_loss_and_lazy_agrees_with_eager() {
    let _g = serial();
    let (eager, _) = train(&Device::cpu(), 30);
    assert!(
        eager[29] < 0.1 * eager[0],
        "loss did not fall enough: {eager:?}"
    );
    let (lazy, _) = train(&Device::lazy(&Device::cpu()), 30);
    for (i, (a, b)) in lazy.iter().zip(&eager).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1e-6),
            "step {i}: lazy {a}, eager {b}"
        );
    }
}

/// The learning rate and bias corrections change every step but are
/// trace arguments, so ten lazy steps compile at most twice (the first
/// trace, then one widening of its per-step constants).
#[test]
fn a_scheduled_lazy_loop_compiles_at_most_twice() {
    let _g = serial();
    let schedule = Cosine {
        max_lr: 0.2,
        min_lr: 0.02,
        warmup: 2,
        total: 10,
    };
    assert_ne!(schedule.lr(3), schedule.lr(4));
    let (_, compiled) = train(&Device::lazy(&Device::cpu()), 10);
    assert!(compiled <= 2, "compiled {compiled} traces");

    // SGD with momentum and dampening: its first step, `v = g`, has the
    // same trace as the others.
    let device = Device::lazy(&Device::cpu());
    let mut model = affine(&device);
    let mut opt = Sgd::new(SgdConfig {
        momentum: 0.9,
        dampening: 0.1,
        weight_decay: 0.01,
        ..SgdConfig::default()
    });
    lazy::mark_step();
    let before = lazy::metrics().traces_compiled;
    for step in 0..10 {
        model.requires_grad();
        let loss = (&model.w * &model.w).sum(&[0, 1], false) + model.b.sum(&[0], false);
        let grads = loss.backward().unwrap();
        opt.step_scheduled(&schedule, &mut model, &grads).unwrap();
        lazy::mark_step();
        assert!(loss.item().unwrap().is_finite(), "step {step}");
    }
    let compiled = lazy::metrics().traces_compiled - before;
    assert!(compiled <= 2, "SGD compiled {compiled} traces");
}

/// On the CPU (and the lazy device over it) Adam and AdamW update each
/// parameter with one `AdamUpdate` op: one pass over the parameter, its
/// gradient and both moments, where the separate ops made three kernels
/// that read the moments twice. (The bits are those of the separate ops:
/// `stagecraft-cpu`'s `adam_update_gives_the_separate_ops_bits`; the
/// references above hold for both paths.)
#[test]
fn adam_updates_each_parameter_with_one_op_on_the_cpu() {
    let _g = serial();
    let device = Device::lazy(&Device::cpu());
    lazy::mark_step();
    for decoupled in [false, true] {
        let mut model = affine(&device);
        let grads = grads_for(&model, 0);
        let config = AdamConfig::default();
        let mut opt: Box<dyn Optimizer> = if decoupled {
            Box::new(AdamW::new(config))
        } else {
            Box::new(Adam::new(config))
        };
        opt.step(&mut model, &grads).unwrap();
        let trace = lazy::trace_text(&model.w).unwrap();
        assert_eq!(trace.matches("AdamUpdate").count(), 1, "{trace}");
        assert!(!trace.contains("Sqrt"), "{trace}");
        lazy::mark_step();
    }
}
