//! Elementwise fusion in instantiation: kernel counts and bit-identical
//! results against eager execution.

use stagecraft::layers::runtime::executor;
use stagecraft::{function, Device, Tensor};

fn input(n: usize) -> Tensor<f32> {
    let v: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 0.05 - 2.0).collect();
    Tensor::from_vec(v, &[n], &Device::cpu()).unwrap()
}

fn kernels<F: Fn(Tensor<f32>) -> Tensor<f32>>(
    f: &stagecraft::StagedFunction<Tensor<f32>, Tensor<f32>, F>,
    x: &Tensor<f32>,
) -> usize {
    let traced = f.traced_function(x).expect("traced");
    executor::instantiate(traced, Device::cpu())
        .unwrap()
        .kernel_count()
}

#[test]
fn a_chain_is_one_kernel_and_matches_eager() {
    let chain = |x: Tensor<f32>| ((&x * 2.0 + 1.0) * &x - 3.0).relu();
    let staged = function(chain);
    for n in [7, 5000, 100_000] {
        let x = input(n);
        let eager = chain(x.clone()).to_vec().unwrap();
        assert_eq!(staged.call(x.clone()).to_vec().unwrap(), eager, "n = {n}");
        assert_eq!(kernels(&staged, &x), 1);
    }
}

/// The B3 chain: eight ops, one kernel.
#[test]
fn the_b3_chain_is_one_kernel() {
    let b3 = |x: Tensor<f32>| {
        let t = &x * 2.0;
        let t = t + 1.0;
        let t = t * &x;
        let t = t - 3.0;
        let t = t.relu();
        let t = t * 0.5;
        let t = t + &x;
        &t * &t
    };
    let staged = function(b3);
    let x = input(70_000);
    assert_eq!(
        staged.call(x.clone()).to_vec().unwrap(),
        b3(x.clone()).to_vec().unwrap()
    );
    // `t * t` reads t twice, from one node: still one kernel.
    assert_eq!(kernels(&staged, &x), 1);
}

/// An elementwise tree feeding a reduction is one kernel: the tree's
/// values are folded as they are computed, in the unfused order.
#[test]
fn a_tree_and_its_reduction_are_one_kernel() {
    let tree = |x: Tensor<f32>| {
        let a = x.tanh() * 0.5;
        let b = x.sigmoid() - x.exp().log();
        (a + b).sum(&[0], false)
    };
    let staged = function(tree);
    for n in [3000, 200_000] {
        let x = input(n);
        let got = staged.call(x.clone()).to_vec().unwrap();
        assert_eq!(got, tree(x.clone()).to_vec().unwrap(), "n = {n}");
        assert_eq!(kernels(&staged, &x), 1);
    }
}

/// A dense layer, `relu(x @ w + b)`, is one kernel: the bias (broadcast
/// over rows) and the activation run as the matmul's epilogue.
#[test]
fn a_dense_layer_is_one_kernel_and_matches_eager() {
    let d = Device::cpu();
    let (k, n) = (48, 40);
    let w: Vec<f32> = (0..k * n)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let b: Vec<f32> = (0..n).map(|i| (i as f32 - 20.0) / 10.0).collect();
    let w = Tensor::from_vec(w, &[k, n], &d).unwrap();
    let b = Tensor::from_vec(b, &[n], &d).unwrap();
    let dense = move |x: Tensor<f32>| (x.matmul(&w) + &b).relu();
    let staged = function(dense.clone());
    let x = input(64 * k).reshape(&[64, k]);
    assert_eq!(
        staged.call(x.clone()).to_vec().unwrap(),
        dense(x.clone()).to_vec().unwrap()
    );
    assert_eq!(kernels(&staged, &x), 1);
}
