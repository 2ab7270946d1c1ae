//! Optimizers ([`Sgd`], [`Adam`], [`AdamW`]) that update a [`Module`]'s
//! parameters from the [`Gradients`] of a loss, and learning-rate
//! schedules ([`LrSchedule`]).
//!
//! Tensors are immutable, so a step computes each parameter's new value
//! and stores it back through [`Module::visit_params_mut`]; optimizer
//! state (momentum, moments) lives in the optimizer, keyed by parameter
//! name, and is created as zeros on a parameter's first step.
//!
//! Everything that changes from step to step (the learning rate, Adam's
//! bias corrections, AdamW's decay factor) enters the update as rank-0
//! tensors, never as constants baked into ops, so on the lazy device
//! every step records the same trace up to its input values and a
//! training loop replays one cached trace after at most one widening
//! compile. Those values are computed on the host in f64 and rounded to
//! f32 once.
//!
//! On the CPU (eager, or as the lazy device's target) Adam and AdamW
//! update each parameter with one `AdamUpdate` op, a single pass over the
//! parameter, its gradient and both moments with the same roundings as
//! the separate ops; elsewhere they run the separate ops.
//!
//! ```
//! use stagecraft::nn::{join, Module, ModuleExt};
//! use stagecraft::optim::{AdamConfig, AdamW, Cosine, LrSchedule, Optimizer};
//! use stagecraft::{Device, Tensor};
//!
//! struct Line { w: Tensor<f32> }
//! impl Module for Line {
//!     fn visit_params(&self, p: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
//!         f(&join(p, "w"), &self.w);
//!     }
//!     fn visit_params_mut(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
//!         f(&join(p, "w"), &mut self.w);
//!     }
//! }
//!
//! let cpu = Device::cpu();
//! let mut model = Line { w: Tensor::from_vec(vec![3.0, -2.0], &[2, 1], &cpu)? };
//! let mut opt = AdamW::new(AdamConfig { lr: 0.1, ..AdamConfig::default() });
//! let sched = Cosine { max_lr: 0.1, min_lr: 0.01, warmup: 2, total: 20 };
//! model.requires_grad(); // once: updates keep parameters marked
//! for _ in 0..20 {
//!     let loss = (&model.w * &model.w).sum(&[0, 1], false);
//!     let grads = loss.backward()?;
//!     opt.set_lr(sched.lr(opt.step_count()));
//!     opt.step(&mut model, &grads)?;
//! }
//! assert_eq!(opt.step_count(), 20);
//! assert!(model.w.to_vec()?.iter().all(|w| w.abs() < 2.0));
//! # Ok::<(), stagecraft::Error>(())
//! ```

#![deny(missing_docs)]

mod schedule;

pub use schedule::{Constant, Cosine, LinearWarmup, LrSchedule, StepDecay};

use crate::nn::Module;
use crate::{Device, Error, Gradients, Result, Tensor};
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_tensor::{DType, Location};
use std::collections::HashMap;
use std::fmt;

/// Something that updates a model's parameters from their gradients.
pub trait Optimizer {
    /// Replaces every parameter of `model` that has a gradient in `grads`
    /// by its updated value; parameters without one are left unchanged
    /// (frozen, or unused by the loss). A gradient whose shape differs from
    /// its parameter's is an error naming the parameter, reported before
    /// anything changes.
    fn step(&mut self, model: &mut dyn Module, grads: &Gradients) -> Result<()>;

    /// The learning rate the next step uses (before each group's scale).
    fn lr(&self) -> f64;

    /// Sets the learning rate for the following steps.
    fn set_lr(&mut self, lr: f64);

    /// Steps taken so far.
    fn step_count(&self) -> u64;

    /// Sets the learning rate from `schedule` for the coming step (number
    /// [`Optimizer::step_count`]), then takes it.
    fn step_scheduled(
        &mut self,
        schedule: &dyn LrSchedule,
        model: &mut dyn Module,
        grads: &Gradients,
    ) -> Result<()> {
        self.set_lr(schedule.lr(self.step_count()));
        self.step(model, grads)
    }
}

/// How one parameter is optimized, as chosen by a grouping function from
/// its name and dimensions (see [`AdamW::with_groups`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupOptions {
    /// Multiplies the optimizer's learning rate for this parameter.
    pub lr_scale: f64,
    /// Weight decay for this parameter, in place of the config's.
    pub weight_decay: f64,
}

/// A grouping function: [`GroupOptions`] for a parameter's name and
/// dimensions, asked once per parameter, on its first step.
pub type GroupFn = Box<dyn Fn(&str, &[usize]) -> GroupOptions + Send + Sync>;

/// One parameter's optimizer state.
struct Slot {
    group: GroupOptions,
    /// Per-parameter buffers (velocity; Adam's moments), zeros at first.
    bufs: Vec<Tensor<f32>>,
    /// Steps this parameter has taken: like PyTorch, bias corrections and
    /// SGD's first-step rule count a parameter's own steps, so a parameter
    /// that starts receiving gradients late is not treated as warmed up.
    steps: u64,
}

/// What every optimizer keeps: learning rate, step count, grouping and
/// state by parameter name.
struct State {
    lr: f64,
    steps: u64,
    groups: GroupFn,
    slots: HashMap<String, Slot>,
}

/// The per-step host values of one group, as tensors on one device.
struct StepScalars {
    group: GroupOptions,
    device: Device,
    steps: u64,
    values: Vec<Tensor<f32>>,
}

impl State {
    fn new(lr: f64, groups: GroupFn) -> State {
        State {
            lr,
            steps: 0,
            groups,
            slots: HashMap::new(),
        }
    }

    /// One step. `host(group, lr, t)` gives the per-step values for a
    /// group's parameters at their step `t` (from 1); they reach `update`
    /// as rank-0 f32 tensors, made once per group, device and `t`, so the
    /// parameters of a group share them in the trace. `update(p, g, bufs,
    /// scalars, group)` returns the new parameter and replaces `bufs`.
    fn step(
        &mut self,
        model: &mut dyn Module,
        grads: &Gradients,
        n_bufs: usize,
        host: impl Fn(&GroupOptions, f64, u64) -> Vec<f64>,
        mut update: impl FnMut(
            &Tensor<f32>,
            Tensor<f32>,
            &mut [Tensor<f32>],
            &[Tensor<f32>],
            &GroupOptions,
        ) -> Tensor<f32>,
    ) -> Result<()> {
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(Error::invalid(format!(
                "optimizer: the learning rate must be finite and non-negative, got {}",
                self.lr
            )));
        }
        // Everything that can fail is checked before any parameter changes,
        // so a failed step leaves the model as it was.
        let mut failed = None;
        let (groups, slots) = (&self.groups, &mut self.slots);
        model.visit_params("", &mut |name, p| {
            let Some(g) = grads.get(p) else { return };
            if failed.is_some() {
                return;
            }
            if g.dims() != p.dims() {
                failed = Some(Error::invalid(format!(
                    "optimizer: the gradient of parameter `{name}` has shape {:?}, \
                     the parameter {:?}",
                    g.dims(),
                    p.dims()
                )));
                return;
            }
            if let Some(slot) = slots.get(name) {
                // Same name, new shape (a model rebuilt between steps): the
                // old state cannot be combined with the new parameter.
                if slot.bufs.first().is_some_and(|b| b.dims() != p.dims()) {
                    failed = Some(Error::invalid(format!(
                        "optimizer: parameter `{name}` has shape {:?}, its optimizer state {:?}",
                        p.dims(),
                        slot.bufs[0].dims()
                    )));
                }
                return;
            }
            let group = groups(name, p.dims());
            let valid = |x: f64| x.is_finite() && x >= 0.0;
            if !(valid(group.lr_scale) && valid(group.weight_decay)) {
                failed = Some(Error::invalid(format!(
                    "optimizer: parameter `{name}` got group options {group:?}; \
                     lr_scale and weight_decay must be finite and non-negative"
                )));
                return;
            }
            // Zeros made on the host rather than by a fill op: on the lazy
            // device a fill would be part of the first step's trace only,
            // so the second step would record a different trace; as data
            // the buffers are leaves in every step's trace alike.
            let numel = p.dims().iter().product();
            let bufs = (0..n_bufs)
                .map(|_| Tensor::from_vec(vec![0.0; numel], p.dims(), &p.device()))
                .collect::<Result<Vec<_>>>();
            let bufs = match bufs {
                Ok(bufs) => bufs,
                Err(e) => {
                    failed = Some(e);
                    return;
                }
            };
            let slot = Slot {
                group,
                bufs,
                steps: 0,
            };
            slots.insert(name.to_string(), slot);
        });
        if let Some(err) = failed {
            return Err(err);
        }
        let lr = self.lr;
        let mut scalars: Vec<StepScalars> = Vec::new();
        // Updates are not part of any gradient; without no_grad the new
        // values would be recorded as depending on the (marked) old ones.
        crate::no_grad(|| {
            model.visit_params_mut("", &mut |name, p| {
                let (Some(g), Some(slot)) = (grads.get(p), slots.get_mut(name)) else {
                    return;
                };
                slot.steps += 1;
                let device = p.device();
                let found = scalars.iter().position(|s| {
                    s.group == slot.group && s.device == device && s.steps == slot.steps
                });
                let index = found.unwrap_or_else(|| {
                    let values = host(&slot.group, lr, slot.steps)
                        .into_iter()
                        .map(|v| Tensor::scalar(v as f32, &device))
                        .collect();
                    scalars.push(StepScalars {
                        group: slot.group,
                        device,
                        steps: slot.steps,
                        values,
                    });
                    scalars.len() - 1
                });
                let updated = update(p, g, &mut slot.bufs, &scalars[index].values, &slot.group);
                crate::autodiff::replace_keeping_mark(p, updated);
            })
        });
        self.steps += 1;
        Ok(())
    }
}

impl fmt::Debug for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("State")
            .field("lr", &self.lr)
            .field("steps", &self.steps)
            .field("params", &self.slots.len())
            .finish()
    }
}

fn same_decay_for_all(weight_decay: f64) -> GroupFn {
    Box::new(move |_, _| GroupOptions {
        lr_scale: 1.0,
        weight_decay,
    })
}

/// [`Sgd`]'s hyperparameters, with PyTorch's meaning.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor; 0 for plain SGD.
    pub momentum: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
    /// L2 penalty: `weight_decay * p` is added to the gradient. The value
    /// [`Sgd::new`] gives every parameter.
    pub weight_decay: f64,
    /// Dampening of the gradient's share of the velocity (not applied on a
    /// parameter's first step, where the velocity is the gradient).
    pub dampening: f64,
}

impl Default for SgdConfig {
    /// Plain SGD with learning rate 0.01.
    fn default() -> SgdConfig {
        SgdConfig {
            lr: 1e-2,
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            dampening: 0.0,
        }
    }
}

/// Stochastic gradient descent with optional momentum, Nesterov momentum,
/// dampening and weight decay, as `torch.optim.SGD`:
///
/// ```text
/// g = grad + weight_decay * p
/// v = momentum * v + (1 - dampening) * g     (first step: v = g)
/// g = nesterov ? g + momentum * v : v
/// p = p - lr * g
/// ```
#[derive(Debug)]
pub struct Sgd {
    config: SgdConfig,
    state: State,
}

impl Sgd {
    /// SGD with `config.weight_decay` for every parameter.
    pub fn new(config: SgdConfig) -> Sgd {
        Sgd::with_groups(config, same_decay_for_all(config.weight_decay))
    }

    /// SGD whose per-parameter learning-rate scale and weight decay come
    /// from `groups(name, dims)` (`config.weight_decay` is then unused).
    pub fn with_groups(
        config: SgdConfig,
        groups: impl Fn(&str, &[usize]) -> GroupOptions + Send + Sync + 'static,
    ) -> Sgd {
        Sgd {
            config,
            state: State::new(config.lr, Box::new(groups)),
        }
    }

    /// The hyperparameters (`lr` as given at construction).
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, model: &mut dyn Module, grads: &Gradients) -> Result<()> {
        let c = self.config;
        if !(c.momentum.is_finite() && c.momentum >= 0.0 && c.dampening.is_finite()) {
            return Err(Error::invalid(format!(
                "Sgd: momentum must be finite and non-negative and dampening finite, got {c:?}"
            )));
        }
        if c.nesterov && !(c.momentum > 0.0 && c.dampening == 0.0) {
            return Err(Error::invalid(format!(
                "Sgd: Nesterov momentum needs momentum > 0 and zero dampening, got {c:?}"
            )));
        }
        let momentum = c.momentum as f32;
        let n_bufs = usize::from(c.momentum != 0.0);
        let host = |group: &GroupOptions, lr: f64, t: u64| {
            // The velocity starts at zero, so `momentum * 0 + 1 * g` is
            // exactly PyTorch's first-step `v = g`, with the same trace as
            // every later step.
            let first_share = if t == 1 { 1.0 } else { 1.0 - c.dampening };
            vec![lr * group.lr_scale, first_share]
        };
        self.state
            .step(model, grads, n_bufs, host, |p, g, bufs, s, group| {
                let mut g = if group.weight_decay != 0.0 {
                    g + p * group.weight_decay as f32
                } else {
                    g
                };
                if let [velocity] = bufs {
                    let share = if c.dampening != 0.0 {
                        &g * &s[1]
                    } else {
                        g.clone()
                    };
                    let v = &*velocity * momentum + share;
                    g = if c.nesterov {
                        g + &v * momentum
                    } else {
                        v.clone()
                    };
                    *velocity = v;
                }
                p - g * &s[0]
            })
    }

    fn lr(&self) -> f64 {
        self.state.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.state.lr = lr;
    }

    fn step_count(&self) -> u64 {
        self.state.steps
    }
}

/// [`Adam`]'s and [`AdamW`]'s hyperparameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moment estimates.
    pub betas: (f64, f64),
    /// Added to the denominator's square root, for stability.
    pub eps: f64,
    /// Weight decay: an L2 term in the gradient for [`Adam`], decoupled
    /// shrinking for [`AdamW`]. The value `new` uses (for AdamW, for
    /// parameters of two or more dimensions only).
    pub weight_decay: f64,
}

impl Default for AdamConfig {
    /// PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, and no
    /// weight decay.
    fn default() -> AdamConfig {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// What Adam and AdamW share; `decoupled` selects AdamW's decay.
#[derive(Debug)]
struct AdamCore {
    config: AdamConfig,
    decoupled: bool,
    state: State,
}

impl AdamCore {
    fn step(&mut self, model: &mut dyn Module, grads: &Gradients) -> Result<()> {
        let c = self.config;
        let (b1, b2) = c.betas;
        let beta_ok = |b: f64| (0.0..1.0).contains(&b);
        if !(beta_ok(b1) && beta_ok(b2) && c.eps.is_finite() && c.eps >= 0.0) {
            return Err(Error::invalid(format!(
                "Adam: betas must lie in [0, 1) and eps be finite and non-negative, got {c:?}"
            )));
        }
        let decoupled = self.decoupled;
        let host = |group: &GroupOptions, lr: f64, t: u64| {
            let lr = lr * group.lr_scale;
            let t = t as f64;
            // The last value is AdamW's shrink factor, 1 for Adam (a
            // multiplication by 1 changes no bits).
            let decay = if decoupled {
                1.0 - lr * group.weight_decay
            } else {
                1.0
            };
            vec![lr, 1.0 - b1.powf(t), 1.0 - b2.powf(t), decay]
        };
        let hyper = {
            let mut attrs = OpAttrs::new();
            attrs
                .set_float("beta1", b1)
                .set_float("beta2", b2)
                .set_float("eps", c.eps);
            attrs
        };
        let (b1_f, one_minus_b1) = (b1 as f32, (1.0 - b1) as f32);
        let (b2_f, one_minus_b2) = (b2 as f32, (1.0 - b2) as f32);
        let eps = c.eps as f32;
        self.state
            .step(model, grads, 2, host, |p, g, bufs, s, group| {
                let wd = group.weight_decay;
                if runs_adam_update(&p.device()) {
                    // One pass over the parameter's elements: the same
                    // operations as below, in one kernel.
                    let mut attrs = hyper.clone();
                    if !decoupled {
                        attrs.set_float("weight_decay", wd);
                    }
                    let args = [p, &g, &bufs[0], &bufs[1], &s[0], &s[1], &s[2], &s[3]]
                        .iter()
                        .map(|t| t.handle.clone())
                        .collect();
                    let location = Location::caller();
                    let outs =
                        crate::tensor::run_handles(&ops::ADAM_UPDATE, args, &attrs, location);
                    if let [p, m, v] = &outs[..] {
                        bufs[0] = Tensor::from_handle(m.clone());
                        bufs[1] = Tensor::from_handle(v.clone());
                        return Tensor::from_handle(p.clone());
                    }
                }
                let g = if !decoupled && wd != 0.0 {
                    g + p * wd as f32
                } else {
                    g
                };
                let m = &bufs[0] * b1_f + &g * one_minus_b1;
                let v = &bufs[1] * b2_f + (&g * &g) * one_minus_b2;
                let m_hat = &m / &s[1];
                let v_hat = &v / &s[2];
                let direction = m_hat / (v_hat.sqrt() + eps);
                bufs[0] = m;
                bufs[1] = v;
                let p = if decoupled && wd != 0.0 {
                    p * &s[3]
                } else {
                    p.clone()
                };
                p - direction * &s[0]
            })
    }
}

/// Whether parameters on `device` are updated by the one-pass
/// `AdamUpdate` kernel: the CPU has one, on its own or as a lazy device's
/// target; a GPU runs the separate ops (without a kernel it would copy the
/// state to the CPU and back every step).
fn runs_adam_update(device: &Device) -> bool {
    let target = device.lazy_target().unwrap_or(*device);
    !target.is_remote()
        && stagecraft_runtime::kernels::kernel_for(&ops::ADAM_UPDATE, target.kind(), &[DType::F32])
            .is_some()
}

/// Adam (Kingma & Ba) with weight decay as an L2 term in the gradient, as
/// `torch.optim.Adam`:
///
/// ```text
/// g = grad + weight_decay * p
/// m = b1 * m + (1 - b1) * g;   v = b2 * v + (1 - b2) * g²
/// p = p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
/// ```
#[derive(Debug)]
pub struct Adam(AdamCore);

impl Adam {
    /// Adam with `config.weight_decay` for every parameter.
    pub fn new(config: AdamConfig) -> Adam {
        Adam::with_groups(config, same_decay_for_all(config.weight_decay))
    }

    /// Adam whose per-parameter learning-rate scale and weight decay come
    /// from `groups(name, dims)` (`config.weight_decay` is then unused).
    pub fn with_groups(
        config: AdamConfig,
        groups: impl Fn(&str, &[usize]) -> GroupOptions + Send + Sync + 'static,
    ) -> Adam {
        Adam(AdamCore {
            config,
            decoupled: false,
            state: State::new(config.lr, Box::new(groups)),
        })
    }

    /// The hyperparameters (`lr` as given at construction).
    pub fn config(&self) -> &AdamConfig {
        &self.0.config
    }
}

/// AdamW (Loshchilov & Hutter): Adam with decoupled weight decay, as
/// `torch.optim.AdamW`: the parameter first shrinks by `1 - lr * wd`, then
/// takes Adam's step without any decay term in the gradient.
///
/// [`AdamW::new`] decays only parameters of two or more dimensions
/// (weights, embeddings), not biases and normalization gains, as nanoGPT
/// does; [`AdamW::with_groups`] chooses otherwise.
#[derive(Debug)]
pub struct AdamW(AdamCore);

impl AdamW {
    /// AdamW with `config.weight_decay` for parameters of two or more
    /// dimensions and none for the others.
    pub fn new(config: AdamConfig) -> AdamW {
        let wd = config.weight_decay;
        AdamW::with_groups(config, move |_, dims| GroupOptions {
            lr_scale: 1.0,
            weight_decay: if dims.len() >= 2 { wd } else { 0.0 },
        })
    }

    /// AdamW whose per-parameter learning-rate scale and weight decay come
    /// from `groups(name, dims)` (`config.weight_decay` is then unused).
    ///
    /// ```
    /// use stagecraft::optim::{AdamConfig, AdamW, GroupOptions};
    /// // Decay everything but embeddings; train the head ten times slower.
    /// let opt = AdamW::with_groups(AdamConfig::default(), |name, _dims| GroupOptions {
    ///     lr_scale: if name.starts_with("head.") { 0.1 } else { 1.0 },
    ///     weight_decay: if name.contains("emb") { 0.0 } else { 0.1 },
    /// });
    /// # let _ = opt;
    /// ```
    pub fn with_groups(
        config: AdamConfig,
        groups: impl Fn(&str, &[usize]) -> GroupOptions + Send + Sync + 'static,
    ) -> AdamW {
        AdamW(AdamCore {
            config,
            decoupled: true,
            state: State::new(config.lr, Box::new(groups)),
        })
    }

    /// The hyperparameters (`lr` as given at construction).
    pub fn config(&self) -> &AdamConfig {
        &self.0.config
    }
}

macro_rules! adam_optimizer {
    ($ty:ty) => {
        impl Optimizer for $ty {
            fn step(&mut self, model: &mut dyn Module, grads: &Gradients) -> Result<()> {
                self.0.step(model, grads)
            }

            fn lr(&self) -> f64 {
                self.0.state.lr
            }

            fn set_lr(&mut self, lr: f64) {
                self.0.state.lr = lr;
            }

            fn step_count(&self) -> u64 {
                self.0.state.steps
            }
        }
    };
}

adam_optimizer!(Adam);
adam_optimizer!(AdamW);
