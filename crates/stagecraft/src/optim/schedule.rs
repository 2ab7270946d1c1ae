//! Learning-rate schedules: the learning rate as a function of the step.

use std::f64::consts::PI;

/// A learning rate for each step, counted from 0 (the value of
/// [`Optimizer::step_count`](super::Optimizer::step_count) before the step).
///
/// ```
/// use stagecraft::optim::{Cosine, LrSchedule};
/// let s = Cosine { max_lr: 1e-3, min_lr: 1e-4, warmup: 10, total: 100 };
/// assert_eq!(s.lr(0), 1e-3 / 11.0);
/// assert_eq!(s.lr(10), 1e-3);
/// assert_eq!(s.lr(500), 1e-4);
/// ```
pub trait LrSchedule {
    /// The learning rate for `step`.
    fn lr(&self, step: u64) -> f64;
}

/// The same learning rate at every step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Constant(pub f64);

impl LrSchedule for Constant {
    fn lr(&self, _step: u64) -> f64 {
        self.0
    }
}

/// `(step + 1) / (warmup + 1)` of `lr` during the first `warmup` steps,
/// then `lr`: the first step already moves the parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearWarmup {
    /// The learning rate after warm-up.
    pub lr: f64,
    /// Steps to reach `lr`; 0 means none.
    pub warmup: u64,
}

impl LrSchedule for LinearWarmup {
    fn lr(&self, step: u64) -> f64 {
        warmup(self.lr, self.warmup, step).unwrap_or(self.lr)
    }
}

/// nanoGPT's `get_lr`: linear warm-up towards `max_lr` over `warmup`
/// steps (`max_lr · (step + 1) / (warmup + 1)`, as nanoGPT and the
/// PyTorch peer of benchmark B7 do), then a half cosine from `max_lr` down to `min_lr` at step
/// `total`, then `min_lr`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cosine {
    /// The learning rate at the end of warm-up.
    pub max_lr: f64,
    /// The learning rate from step `total` on.
    pub min_lr: f64,
    /// Warm-up steps.
    pub warmup: u64,
    /// The step where the decay reaches `min_lr`.
    pub total: u64,
}

impl LrSchedule for Cosine {
    fn lr(&self, step: u64) -> f64 {
        if let Some(lr) = warmup(self.max_lr, self.warmup, step) {
            return lr;
        }
        // `>=` rather than nanoGPT's `>`: equal at `total` anyway, and it
        // keeps `total == warmup` from dividing by zero.
        if step >= self.total {
            return self.min_lr;
        }
        let ratio = (step - self.warmup) as f64 / (self.total - self.warmup) as f64;
        let coeff = 0.5 * (1.0 + (PI * ratio).cos());
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}

/// `lr * gamma^(step / step_size)` (integer division): the rate drops by
/// `gamma` every `step_size` steps. A `step_size` of 0 never decays.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepDecay {
    /// The initial learning rate.
    pub lr: f64,
    /// Steps between drops.
    pub step_size: u64,
    /// Factor of each drop.
    pub gamma: f64,
}

impl LrSchedule for StepDecay {
    fn lr(&self, step: u64) -> f64 {
        let drops = step.checked_div(self.step_size).unwrap_or(0);
        // Saturating: past 2^31 drops the power is 0 or 1 whatever `gamma`.
        self.lr * self.gamma.powi(i32::try_from(drops).unwrap_or(i32::MAX))
    }
}

/// The warm-up ramp's value, while `step` is in it.
fn warmup(lr: f64, warmup: u64, step: u64) -> Option<f64> {
    (step < warmup).then(|| lr * (step + 1) as f64 / (warmup + 1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1e-12)
    }

    #[test]
    fn constant_and_linear_warmup() {
        assert_eq!(Constant(0.3).lr(12345), 0.3);
        let s = LinearWarmup { lr: 0.8, warmup: 4 };
        for (i, want) in [0.16, 0.32, 0.48, 0.64, 0.8, 0.8].into_iter().enumerate() {
            assert!(close(s.lr(i as u64), want), "step {i}: {}", s.lr(i as u64));
        }
        assert_eq!(LinearWarmup { lr: 0.8, warmup: 0 }.lr(0), 0.8);
    }

    #[test]
    fn cosine_warms_up_then_decays_to_min() {
        let s = Cosine {
            max_lr: 6e-4,
            min_lr: 6e-5,
            warmup: 100,
            total: 1100,
        };
        assert!(close(s.lr(0), 6e-4 / 101.0));
        assert!(close(s.lr(50), 6e-4 * 51.0 / 101.0));
        assert_eq!(s.lr(100), 6e-4);
        // Midpoint of the cosine: halfway between max and min.
        assert!(close(s.lr(600), (6e-4 + 6e-5) / 2.0));
        // A quarter in: min + (max - min) * (1 + cos(pi/4)) / 2.
        let quarter = 6e-5 + (6e-4 - 6e-5) * (1.0 + (PI / 4.0).cos()) / 2.0;
        assert!(close(s.lr(350), quarter));
        assert!(close(
            s.lr(1099),
            6e-5 + (6e-4 - 6e-5) * 0.5 * (1.0 + (PI * 0.999).cos())
        ));
        assert_eq!(s.lr(1100), 6e-5);
        assert_eq!(s.lr(5000), 6e-5);
        // Decreasing over the decay.
        assert!((100..1100).all(|i| s.lr(i + 1) <= s.lr(i)));
    }

    #[test]
    fn cosine_without_decay_span_is_min_after_warmup() {
        let s = Cosine {
            max_lr: 1.0,
            min_lr: 0.1,
            warmup: 10,
            total: 10,
        };
        assert!(close(s.lr(5), 6.0 / 11.0));
        assert_eq!(s.lr(10), 0.1);
    }

    #[test]
    fn step_decay_drops_every_step_size() {
        let s = StepDecay {
            lr: 1.0,
            step_size: 3,
            gamma: 0.5,
        };
        let got: Vec<f64> = (0..8).map(|i| s.lr(i)).collect();
        assert_eq!(got, [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]);
        let never = StepDecay {
            lr: 1.0,
            step_size: 0,
            gamma: 0.5,
        };
        assert_eq!(never.lr(100), 1.0);
    }
}
