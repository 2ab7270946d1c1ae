//! Dropout, the squared norm of a tensor list and gradient-norm clipping:
//! the same values on the eager device, the lazy device and inside a
//! staged `function`; a lazy loop with dropout replays one cached trace;
//! errors name the op and the caller's line.

use stagecraft::{clip_grad_norm, function, grad, lazy, Device, Rng, Tensor};
use std::sync::Mutex;

/// Tests that use the lazy device run one at a time: one of them reads the
/// process-wide lazy metrics, which the others would move.
static SERIAL: Mutex<()> = Mutex::new(());

fn ramp(n: usize, d: &Device) -> Tensor<f32> {
    let values = (0..n).map(|i| (i as f32 - 7.0) * 0.25).collect();
    Tensor::from_vec(values, &[n], d).unwrap()
}

#[test]
fn dropout_agrees_across_modes_and_zeroes_about_p() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cpu = Device::cpu();
    let eager = ramp(4000, &cpu)
        .dropout(0.4, &mut Rng::new(3))
        .to_vec()
        .unwrap();
    let lazy_dev = Device::lazy(&cpu);
    let lazy = ramp(4000, &lazy_dev)
        .dropout(0.4, &mut Rng::new(3))
        .to_vec()
        .unwrap();
    let staged = function(|x: Tensor<f32>| x.dropout(0.4, &mut Rng::new(3)));
    let traced = staged.call(ramp(4000, &cpu)).to_vec().unwrap();
    assert_eq!(eager, lazy);
    assert_eq!(eager, traced);
    let x = ramp(4000, &cpu).to_vec().unwrap();
    let mut dropped = 0;
    for (y, x) in eager.iter().zip(&x) {
        if *y == 0.0 && *x != 0.0 {
            dropped += 1;
        } else {
            // The survivor's value is x·(1/(1-p)) in f64, rounded once.
            let scaled = (*x as f64 * (1.0 / (1.0 - 0.4))) as f32;
            assert_eq!(*y, scaled, "survivors are scaled by 1/(1-p)");
        }
    }
    assert!((1400..1800).contains(&dropped), "{dropped} of 4000 dropped");
    // Another seed, another mask; the same stream continues, not repeats.
    let other = ramp(4000, &cpu)
        .dropout(0.4, &mut Rng::new(4))
        .to_vec()
        .unwrap();
    assert_ne!(eager, other);
    let mut rng = Rng::new(3);
    let first = ramp(4000, &cpu).dropout(0.4, &mut rng).to_vec().unwrap();
    let second = ramp(4000, &cpu).dropout(0.4, &mut rng).to_vec().unwrap();
    assert_eq!(first, eager);
    assert_ne!(first, second);
}

#[test]
fn dropout_of_zero_and_one() {
    let cpu = Device::cpu();
    let x = ramp(64, &cpu);
    assert_eq!(
        x.dropout(0.0, &mut Rng::new(1)).to_vec().unwrap(),
        x.to_vec().unwrap()
    );
    assert!(x
        .dropout(1.0, &mut Rng::new(1))
        .to_vec()
        .unwrap()
        .iter()
        .all(|&v| v == 0.0));
}

#[test]
fn dropout_gradient_is_the_same_mask() {
    let cpu = Device::cpu();
    let x = ramp(256, &cpu);
    let g = grad(|x: &Tensor<f32>| x.dropout(0.5, &mut Rng::new(9)).sum(&[], false))(&x);
    let mask = Tensor::<f32>::ones(&[256], &cpu)
        .dropout(0.5, &mut Rng::new(9))
        .to_vec()
        .unwrap();
    assert_eq!(g.to_vec().unwrap(), mask);
}

#[test]
fn a_lazy_loop_with_dropout_replays_one_trace() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let d = Device::lazy(&Device::cpu());
    let x = ramp(64, &d);
    let mut rng = Rng::new(17);
    lazy::reset_metrics();
    let mut sums = Vec::new();
    for _ in 0..8 {
        let y = (&x.dropout(0.25, &mut rng) * 2.0).sum(&[], false);
        sums.push(y.item().unwrap());
    }
    let m = lazy::metrics();
    assert!(m.traces_compiled <= 2, "{m:?}");
    assert_eq!(m.cache_hits, 8 - m.traces_compiled, "{m:?}");
    // The steps drew different masks, the same ones eager draws.
    let cpu = Device::cpu();
    let x_cpu = ramp(64, &cpu);
    let mut rng = Rng::new(17);
    for (step, got) in sums.iter().enumerate() {
        let want = (&x_cpu.dropout(0.25, &mut rng) * 2.0)
            .sum(&[], false)
            .item()
            .unwrap();
        assert_eq!(*got, want, "step {step}");
    }
    assert!(sums.windows(2).any(|w| w[0] != w[1]));
}

#[test]
fn clip_grad_norm_scales_only_above_the_limit() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cpu = Device::cpu();
    let a = Tensor::<f32>::from_vec(vec![3.0, 0.0], &[2], &cpu).unwrap();
    let b = Tensor::<f32>::from_vec(vec![4.0], &[1, 1], &cpu).unwrap();
    let (clipped, norm) = clip_grad_norm(&[a.clone(), b.clone()], 2.5);
    assert_eq!(norm.item().unwrap(), 5.0);
    let scale = 2.5 / (5.0 + 1e-6f32);
    assert_eq!(clipped[0].to_vec().unwrap(), vec![3.0 * scale, 0.0]);
    assert_eq!(clipped[1].to_vec().unwrap(), vec![4.0 * scale]);
    assert_eq!(clipped[1].dims(), &[1, 1]);
    // Under the limit: unchanged.
    let (same, norm) = clip_grad_norm(&[a.clone(), b.clone()], 10.0);
    assert_eq!(norm.item().unwrap(), 5.0);
    assert_eq!(same[0].to_vec().unwrap(), vec![3.0, 0.0]);
    // Lazy: the same numbers.
    let d = Device::lazy(&cpu);
    let (lazy_clipped, lazy_norm) = clip_grad_norm(&[a.to_device(&d), b.to_device(&d)], 2.5);
    assert_eq!(lazy_norm.item().unwrap(), 5.0);
    assert_eq!(
        lazy_clipped[0].to_vec().unwrap(),
        clipped[0].to_vec().unwrap()
    );
}

#[test]
fn bad_training_calls_name_the_op_and_line() {
    let cpu = Device::cpu();
    let x = ramp(8, &cpu);
    let (bad, line) = (x.dropout(1.5, &mut Rng::new(1)), line!());
    let err = bad.check().unwrap_err();
    assert_eq!(err.op(), Some("Dropout"), "{err}");
    assert_eq!(err.location().unwrap().line(), line, "{err}");
    assert!(err.to_string().contains("[0, 1]"), "{err}");

    let (bad, line) = (Tensor::<f32>::squared_norm(&[]), line!());
    let err = bad.check().unwrap_err();
    assert_eq!(err.op(), Some("SquaredNorm"), "{err}");
    assert_eq!(err.location().unwrap().line(), line, "{err}");

    let ((clipped, norm), line) = (clip_grad_norm(std::slice::from_ref(&x), -1.0), line!());
    let err = norm.check().unwrap_err();
    assert_eq!(err.op(), Some("ClipGradNorm"), "{err}");
    assert_eq!(err.location().unwrap().line(), line, "{err}");
    assert!(clipped[0].check().is_err());

    // Zero-size tensors: dropout keeps the shape, the norm is 0.
    let empty = Tensor::<f32>::zeros(&[3, 0], &cpu);
    assert_eq!(empty.dropout(0.5, &mut Rng::new(2)).dims(), &[3, 0]);
    assert_eq!(Tensor::squared_norm(&[&empty]).item().unwrap(), 0.0);
    // NaN passes through a survivor and the norm.
    let nan = Tensor::<f32>::from_vec(vec![f32::NAN], &[1], &cpu).unwrap();
    assert!(Tensor::squared_norm(&[&nan]).item().unwrap().is_nan());
}
