//! The gradient of a slice is one pad, and the gradient of a pad one
//! slice, whatever the rank: they used to be one op per axis, each a copy
//! of the whole gradient, most with nothing to pad or cut (the `narrow`
//! of a `[B, T, 3C]` projection into queries, keys and values cost three
//! copies per part). These tests fail if that comes back.
//! Their own test binary: profiling is process-wide.

mod common;

use common::kernels_run;
use stagecraft::{grad, Device, Tensor};

fn count(ran: &[String], kernel: &str) -> usize {
    ran.iter().filter(|k| k.as_str() == kernel).count()
}

fn input(dims: &[usize], device: &Device) -> Tensor<f32> {
    let n = dims.iter().product();
    let values = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
    Tensor::from_vec(values, dims, device).unwrap()
}

/// `x.narrow(2, 4, 4)` of a [2, 3, 12] tensor, squared: the gradient is
/// `2x` inside the slice and 0 elsewhere, from one pad. (A gradient that
/// does not depend on `x` would be folded into a constant by the lazy
/// trace's compile, and no pad would run at all.)
#[test]
fn a_narrow_of_one_axis_backs_through_one_pad() {
    let cpu = Device::cpu();
    for device in [cpu, Device::lazy(&cpu)] {
        let x = input(&[2, 3, 12], &device);
        let mut g = None;
        let ran = kernels_run(|| {
            let dx = grad(|x: &Tensor<f32>| {
                let part = x.narrow(2, 4, 4);
                (&part * &part).sum(&[], false)
            })(&x);
            dx.to_vec().unwrap();
            g = Some(dx);
        });
        assert_eq!(count(&ran, "Pad"), 1, "{device}: {ran:?}");
        let got = g.unwrap().to_vec().unwrap();
        let values = x.to_vec().unwrap();
        for (i, v) in got.iter().enumerate() {
            let inside = (4..8).contains(&(i % 12));
            let want = if inside { 2.0 * values[i] } else { 0.0 };
            assert_eq!(*v, want, "element {i}");
        }
    }
}

/// A slice that cuts two axes, one of them with a step: still one pad at
/// the end (the step needs its own spreading ops), and the right values.
#[test]
fn a_strided_slice_of_two_axes_backs_through_one_final_pad() {
    let x = input(&[4, 6], &Device::cpu());
    let mut g = None;
    let ran = kernels_run(|| {
        let dx = grad(|x: &Tensor<f32>| x.slice(&[1, 0], &[3, 6], &[1, 2]).sum(&[], false))(&x);
        dx.to_vec().unwrap();
        g = Some(dx);
    });
    // One pad spreads the strided axis, one places the whole slice.
    assert_eq!(count(&ran, "Pad"), 2, "{ran:?}");
    let got = g.unwrap().to_vec().unwrap();
    for r in 0..4 {
        for c in 0..6 {
            let taken = (1..3).contains(&r) && c % 2 == 0;
            assert_eq!(got[r * 6 + c], if taken { 1.0 } else { 0.0 }, "({r}, {c})");
        }
    }
}

/// A full slice passes its gradient through without a copy; a pad's
/// gradient is one slice.
#[test]
fn a_full_slice_backs_through_nothing_and_a_pad_through_one_slice() {
    let x = input(&[2, 3, 4], &Device::cpu());
    let ran = kernels_run(|| {
        let dx = grad(|x: &Tensor<f32>| x.narrow(1, 0, 3).sum(&[], false))(&x);
        assert_eq!(dx.to_vec().unwrap(), vec![1.0; 24]);
    });
    assert_eq!(count(&ran, "Pad"), 0, "{ran:?}");
    let ran = kernels_run(|| {
        let dx = grad(|x: &Tensor<f32>| {
            let p = x.pad(&[(1, 0), (0, 2), (3, 1)], 0.0);
            (&p * &p).sum(&[], false)
        })(&x);
        let want: Vec<f32> = x.to_vec().unwrap().iter().map(|v| 2.0 * v).collect();
        assert_eq!(dx.to_vec().unwrap(), want);
    });
    assert_eq!(count(&ran, "Slice"), 1, "{ran:?}");
}

/// Splitting a `[2, 3, 12]` tensor into three parts along its last axis
/// (a transformer's queries, keys and values): eagerly the gradient is
/// three pads summed; staged on the lazy device it is one concatenation,
/// no pad, with the same bits (signed zeros included).
#[test]
fn a_split_backs_through_one_concatenation_when_staged() {
    let cpu = Device::cpu();
    let mut results = Vec::new();
    for device in [cpu, Device::lazy(&cpu)] {
        let mut values: Vec<f32> = (0..72).map(|i| (i % 7) as f32 - 3.0).collect();
        values[5] = -0.0;
        let x = Tensor::from_vec(values, &[2, 3, 12], &device).unwrap();
        let mut g = None;
        let ran = kernels_run(|| {
            let dx = grad(|x: &Tensor<f32>| {
                let parts: Vec<Tensor<f32>> = (0..3).map(|i| x.narrow(2, 4 * i, 4)).collect();
                // A product of the parts, so that each part's gradient
                // depends on the others (and -0 reaches a gradient).
                let mixed = &(&parts[0] * &parts[1]) * &parts[2];
                mixed.sum(&[], false)
            })(&x);
            dx.to_vec().unwrap();
            g = Some(dx);
        });
        let (pads, concats) = (count(&ran, "Pad"), count(&ran, "Concat"));
        if device == cpu {
            assert_eq!((pads, concats), (3, 0), "{device}: {ran:?}");
        } else {
            assert_eq!((pads, concats), (0, 1), "{device}: {ran:?}");
        }
        let bits: Vec<u32> = g
            .unwrap()
            .to_vec()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        results.push(bits);
    }
    assert_eq!(results[0], results[1]);
}
