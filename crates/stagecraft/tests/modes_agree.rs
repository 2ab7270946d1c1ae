//! Property test: random small programs give the same results on the eager
//! device, on the lazy device and inside a staged `function`.

use proptest::prelude::*;
use stagecraft::{cond, function, lazy, while_loop, Device, Tensor};

#[derive(Clone, Debug)]
enum Step {
    Unary(u8),
    ScalarMul(f32),
    AddSelfT,
    ReduceKeep(bool),
    Cond(f32),
    Loop(u8),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u8..6).prop_map(Step::Unary),
        (-2.0f32..2.0).prop_map(Step::ScalarMul),
        Just(Step::AddSelfT),
        any::<bool>().prop_map(Step::ReduceKeep),
        (-5.0f32..5.0).prop_map(Step::Cond),
        (1u8..4).prop_map(Step::Loop),
    ]
}

/// Runs the program on `x` ([4, 4]); every step keeps the shape.
fn program(steps: &[Step], x: Tensor<f32>) -> Tensor<f32> {
    let d = x.device();
    let mut t = x;
    for s in steps {
        t = match s {
            Step::Unary(0) => t.tanh(),
            Step::Unary(1) => t.sigmoid(),
            Step::Unary(2) => t.relu(),
            Step::Unary(3) => t.sin(),
            Step::Unary(4) => t.abs().sqrt(),
            Step::Unary(_) => -&t,
            Step::ScalarMul(k) => &t * *k,
            Step::AddSelfT => &t + &t.transpose(0, 1),
            Step::ReduceKeep(max) => {
                let r = if *max {
                    t.max(&[1], true)
                } else {
                    t.mean(&[0], true)
                };
                &t - &r
            }
            Step::Cond(threshold) => {
                let p = t.sum(&[0, 1], false).gt(&Tensor::scalar(*threshold, &d));
                cond(&p, || &t * 0.5, || &t + 1.0)
            }
            Step::Loop(n) => {
                let (out, _) = while_loop(
                    (t.clone(), Tensor::<i32>::scalar(0, &d)),
                    |(_, i)| i.lt(&Tensor::scalar(*n as i32, &d)),
                    |(v, i)| (v.cos(), i + 1),
                );
                out
            }
        };
    }
    t
}

fn input(seed: u32, d: &Device) -> Tensor<f32> {
    let v: Vec<f32> = (0..16)
        .map(|i| ((i * 7 + seed as usize) % 11) as f32 * 0.3 - 1.5)
        .collect();
    Tensor::from_vec(v, &[4, 4], d).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn eager_lazy_and_function_agree(steps in prop::collection::vec(step(), 1..8), seed in 0u32..50) {
        let cpu = Device::cpu();
        let eager = program(&steps, input(seed, &cpu)).to_vec().unwrap();
        let lazy_dev = Device::lazy(&cpu);
        let lazy_out = program(&steps, input(seed, &lazy_dev));
        lazy::mark_step();
        let lazy_values = lazy_out.to_vec().unwrap();
        let staged = function(|x: Tensor<f32>| program(&steps, x));
        let staged_values = staged.call(input(seed, &cpu)).to_vec().unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&eager), bits(&lazy_values), "lazy differs");
        prop_assert_eq!(bits(&eager), bits(&staged_values), "function differs");
    }
}

/// Every everyday shape and indexing method, composed: `x` is [4, 4] and
/// the result a few values of different shapes. Index tensors are made
/// from Rust numbers on `x`'s device (inside a staged function: baked
/// constants).
fn everyday_ops(x: &Tensor<f32>) -> Vec<Tensor<f32>> {
    let d = x.device();
    let idx = Tensor::<i64>::from_vec(vec![3, 0, 0, -1, 2, 1, 1, 3], &[2, 4], &d).unwrap();
    let rows = Tensor::<i32>::from_vec(vec![1, 3, 1], &[3], &d).unwrap();
    let stacked = Tensor::stack(&[x, &x.tril(0), &x.triu(1)], 1); // [4, 3, 4]
    let flat = stacked.flatten(0, 1); // [12, 4]
    let parts = flat.split(&[5, 7], 0);
    let chunks = x.chunk(3, 1); // [4, 2], [4, 2]
    let tiled = chunks[1].tile(&[1, 2]).repeat(&[2, 1]); // [8, 4]
    let summed = tiled.cumsum(0) + x.expand(&[2, -1, -1]).reshape(&[8, 4]);
    let scattered = x.scatter_add(0, &idx, &parts[0].narrow(0, 0, 2));
    let added = x.index_add(0, &rows, &parts[1].narrow(0, 1, 3));
    let taken = scattered.take_along_axis(0, &idx);
    let options = stagecraft::CumsumOptions {
        exclusive: true,
        reverse: true,
    };
    vec![
        summed,
        added.cumsum_with(-1, options),
        taken,
        Tensor::concat(&[&chunks[0], &parts[0].narrow(0, 0, 4).narrow(1, 0, 2)], 1),
    ]
}

#[stagecraft::stage]
fn staged_everyday_ops(x: Tensor<f32>) -> Vec<Tensor<f32>> {
    everyday_ops(&x)
}

/// The everyday ops give the same bits eagerly, on the lazy device, inside
/// `function` and under `#[stage]`; their gradients agree (eager and lazy
/// tapes, and through `function`).
#[test]
fn everyday_shape_and_indexing_ops_agree_across_modes() {
    let cpu = Device::cpu();
    let lazy_dev = Device::lazy(&cpu);
    let bits = |ts: &[Tensor<f32>]| -> Vec<(Vec<usize>, Vec<u32>)> {
        ts.iter()
            .map(|t| {
                let v = t.to_vec().unwrap();
                (t.dims().to_vec(), v.iter().map(|x| x.to_bits()).collect())
            })
            .collect()
    };
    let loss = |ts: Vec<Tensor<f32>>| {
        ts.iter()
            .map(|t| (t * t).sum(&[], false))
            .reduce(|a, b| a + b)
            .unwrap()
    };
    let staged = function(|x: Tensor<f32>| everyday_ops(&x));
    for seed in 0..3 {
        let eager = everyday_ops(&input(seed, &cpu));
        let want = bits(&eager);
        let lazy_out = everyday_ops(&input(seed, &lazy_dev));
        lazy::mark_step();
        assert_eq!(bits(&lazy_out), want, "lazy");
        assert_eq!(bits(&staged.call(input(seed, &cpu))), want, "function");
        assert_eq!(
            bits(&staged_everyday_ops(input(seed, &cpu))),
            want,
            "#[stage]"
        );
        let g_eager = stagecraft::grad(|x: &Tensor<f32>| loss(everyday_ops(x)))(&input(seed, &cpu));
        let g_lazy =
            stagecraft::grad(|x: &Tensor<f32>| loss(everyday_ops(x)))(&input(seed, &lazy_dev));
        let g_function =
            stagecraft::grad(|x: &Tensor<f32>| loss(staged.call(x.clone())))(&input(seed, &cpu));
        // Gradients may sum their contributions in another order in a
        // graph than on the tape: equal up to rounding.
        let want = g_eager.to_vec().unwrap();
        for (mode, g) in [("lazy", g_lazy), ("function", g_function)] {
            let got = g.to_vec().unwrap();
            assert_eq!(got.len(), want.len());
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{mode} gradient: {got:?} vs {want:?}"
                );
            }
        }
    }
}
