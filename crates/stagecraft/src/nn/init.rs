//! Parameter initializers, drawn on a device from a seeded [`Rng`].
//!
//! Each is one random op: the values depend only on the stream's seed and
//! position, never on the device or the execution mode. The fan-based
//! initializers take the fans explicitly; [`fans`] computes PyTorch's for
//! a weight shape.

use crate::{Device, Rng, Tensor};

/// `N(mean, std²)` values of shape `dims`.
#[track_caller]
pub fn normal(dims: &[usize], mean: f64, std: f64, rng: &mut Rng, device: &Device) -> Tensor<f32> {
    Tensor::rand_normal(dims, mean, std, rng, device)
}

/// Uniform values in `[low, high)` of shape `dims`.
#[track_caller]
pub fn uniform(dims: &[usize], low: f64, high: f64, rng: &mut Rng, device: &Device) -> Tensor<f32> {
    Tensor::rand_uniform(dims, low, high, rng, device)
}

/// He (Kaiming) uniform for ReLU layers: uniform in `±√2·√(3/fan_in)`, so
/// the variance is `2/fan_in` (PyTorch's `kaiming_uniform_` with its
/// default `nonlinearity='leaky_relu', a=0`, whose gain is `√2`).
#[track_caller]
pub fn kaiming_uniform(
    dims: &[usize],
    fan_in: usize,
    rng: &mut Rng,
    device: &Device,
) -> Tensor<f32> {
    let bound = (6.0 / fan_in.max(1) as f64).sqrt();
    uniform(dims, -bound, bound, rng, device)
}

/// He (Kaiming) normal: `N(0, 2/fan_in)`.
#[track_caller]
pub fn kaiming_normal(
    dims: &[usize],
    fan_in: usize,
    rng: &mut Rng,
    device: &Device,
) -> Tensor<f32> {
    let std = (2.0 / fan_in.max(1) as f64).sqrt();
    normal(dims, 0.0, std, rng, device)
}

/// Glorot (Xavier) uniform: uniform in `±√(6/(fan_in + fan_out))`.
#[track_caller]
pub fn xavier_uniform(
    dims: &[usize],
    fan_in: usize,
    fan_out: usize,
    rng: &mut Rng,
    device: &Device,
) -> Tensor<f32> {
    let bound = (6.0 / (fan_in + fan_out).max(1) as f64).sqrt();
    uniform(dims, -bound, bound, rng, device)
}

/// Glorot (Xavier) normal: `N(0, 2/(fan_in + fan_out))`.
#[track_caller]
pub fn xavier_normal(
    dims: &[usize],
    fan_in: usize,
    fan_out: usize,
    rng: &mut Rng,
    device: &Device,
) -> Tensor<f32> {
    let std = (2.0 / (fan_in + fan_out).max(1) as f64).sqrt();
    normal(dims, 0.0, std, rng, device)
}

/// PyTorch's `(fan_in, fan_out)` of a weight in its layout (`[out, in]`,
/// `[out, in/groups, kh, kw]`, ...): `dims[1]` and `dims[0]`, each times
/// the receptive field (the product of the dimensions after the second).
/// A vector counts as `(len, len)`.
pub fn fans(dims: &[usize]) -> (usize, usize) {
    match dims {
        [] => (1, 1),
        [n] => (*n, *n),
        [out, inp, rest @ ..] => {
            let field: usize = rest.iter().product();
            (inp * field, out * field)
        }
    }
}
