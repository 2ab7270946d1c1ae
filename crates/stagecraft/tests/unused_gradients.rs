//! Eager reverse mode runs only the gradient ops whose results are kept:
//! a layer's gradient for its data input (a batch nobody differentiates)
//! is never computed, while one that flows on to an earlier layer is.
//! Their own test binary: profiling is process-wide.

mod common;

use common::kernels_run;
use stagecraft::{no_grad, Conv2dOptions, Device, Tensor};

fn count(ran: &[String], name: &str) -> usize {
    ran.iter().filter(|k| *k == name).count()
}

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 + seed * 11) % 23) as f32 / 23.0 - 0.5)
        .collect()
}

#[test]
fn a_data_input_gets_no_gradient_op() {
    let cpu = Device::cpu();
    let x = Tensor::from_vec(values(4 * 3, 1), &[4, 3], &cpu).unwrap();
    let w = Tensor::from_vec(values(3 * 2, 2), &[3, 2], &cpu)
        .unwrap()
        .requires_grad();
    let mut dw = None;
    let ran = kernels_run(|| {
        let loss = x.matmul(&w).sum(&[], false);
        let grads = loss.backward().unwrap();
        dw = Some(grads.get(&w).unwrap().to_vec().unwrap());
    });
    // The forward product and dw = xᵀ·1; dx = 1·wᵀ is not run.
    assert_eq!(count(&ran, "MatMul"), 2, "{ran:?}");
    // dw[i][j] = Σ over rows of x[r][i].
    let xv = values(12, 1);
    let want: Vec<f32> = (0..6)
        .map(|e| (0..4).map(|r| xv[r * 3 + e / 2]).sum())
        .collect();
    for (got, want) in dw.unwrap().iter().zip(&want) {
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
    }
}

#[test]
fn a_gradient_that_flows_on_is_computed_and_the_data_one_is_not() {
    let cpu = Device::cpu();
    let opts = Conv2dOptions {
        padding: [1, 1],
        ..Conv2dOptions::default()
    };
    // f64 and a smooth network (no ReLU kinks), for central differences.
    let wide = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<f64>>();
    let x = Tensor::from_vec(wide(values(2 * 8 * 8, 3)), &[2, 1, 8, 8], &cpu).unwrap();
    let w1 = Tensor::from_vec(wide(values(4 * 9, 4)), &[4, 1, 3, 3], &cpu)
        .unwrap()
        .requires_grad();
    let w2 = Tensor::from_vec(wide(values(3 * 4 * 9, 5)), &[3, 4, 3, 3], &cpu)
        .unwrap()
        .requires_grad();
    let loss_of = |w1: &Tensor<f64>, w2: &Tensor<f64>| {
        let h = x.conv2d(w1, opts);
        let h = &h * &h;
        let y = h.conv2d(w2, opts);
        (&y * &y).sum(&[], false)
    };
    let mut got = None;
    let ran = kernels_run(|| {
        let grads = loss_of(&w1, &w2).backward().unwrap();
        got = Some(grads.get(&w1).unwrap().to_vec().unwrap());
    });
    // The second layer's input gradient feeds the first layer's filter
    // gradient; the first layer's would be the image's, and is not run.
    assert_eq!(count(&ran, "Conv2dBackpropInput"), 1, "{ran:?}");
    assert_eq!(count(&ran, "Conv2dBackpropFilter"), 2, "{ran:?}");
    // The first filter's gradient against central differences.
    let dw1 = got.unwrap();
    let base = wide(values(4 * 9, 4));
    for (e, &analytic) in dw1.iter().enumerate().step_by(5) {
        let at = |delta: f64| {
            let mut v = base.clone();
            v[e] += delta;
            let w1 = Tensor::from_vec(v, &[4, 1, 3, 3], &cpu).unwrap();
            no_grad(|| loss_of(&w1, &w2).to_vec().unwrap()[0])
        };
        let numeric = (at(1e-4) - at(-1e-4)) / 2e-4;
        assert!(
            (analytic - numeric).abs() <= 1e-5 * (1.0 + numeric.abs()),
            "dw1[{e}]: {analytic} vs {numeric}"
        );
    }
}
