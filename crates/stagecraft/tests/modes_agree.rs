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
