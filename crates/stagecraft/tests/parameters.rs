//! Parameters stay parameters: a tensor marked `requires_grad()` once keeps
//! the mark through `backward`, optimizer steps, `assign`/`sub_assign`
//! under `no_grad`, loading and broadcasting, so a training loop never
//! marks it again.

use stagecraft::distributed::DataParallel;
use stagecraft::nn::{Forward, Linear, Module, ModuleExt};
use stagecraft::optim::{AdamConfig, AdamW, Optimizer, Sgd, SgdConfig};
use stagecraft::{is_grad_enabled, lazy, no_grad, Device, ErrorKind, Rng, Tensor};

fn xor() -> (Tensor<f32>, Tensor<i32>) {
    let cpu = Device::cpu();
    let x = Tensor::from_vec(vec![0., 0., 0., 1., 1., 0., 1., 1.], &[4, 2], &cpu).unwrap();
    let y = Tensor::from_vec(vec![0, 1, 1, 0], &[4], &cpu).unwrap();
    (x, y)
}

fn loss_of(model: &stagecraft::nn::Sequential, x: &Tensor<f32>, y: &Tensor<i32>) -> Tensor<f32> {
    model
        .forward(x)
        .cross_entropy(y, stagecraft::CrossEntropyOptions::default())
}

fn mlp(device: &Device) -> stagecraft::nn::Sequential {
    let mut rng = Rng::new(0);
    stagecraft::nn::Sequential::new()
        .push(Linear::new(2, 16, true, &mut rng, device))
        .push(stagecraft::nn::Activation::Relu)
        .push(Linear::new(16, 2, true, &mut rng, device))
}

fn all_marked(model: &dyn stagecraft::nn::Module) -> bool {
    let mut marked = true;
    model.visit_params("", &mut |_, t| marked &= t.is_requires_grad());
    marked
}

#[test]
fn a_loop_that_marks_once_trains_every_step() {
    let (x, y) = xor();
    let mut model = mlp(&Device::cpu());
    assert!(!all_marked(&model), "parameters start unmarked");
    model.requires_grad();
    let mut opt = AdamW::new(AdamConfig {
        lr: 0.05,
        ..AdamConfig::default()
    });
    let mut losses = Vec::new();
    for step in 0..200 {
        let loss = loss_of(&model, &x, &y);
        let grads = loss.backward().unwrap();
        let mut with_grad = 0;
        model.visit_params("", &mut |_, p| with_grad += grads.get(p).is_some() as usize);
        assert_eq!(with_grad, 4, "step {step}: every parameter has a gradient");
        opt.step(&mut model, &grads).unwrap();
        assert!(all_marked(&model), "step {step}: the update kept the marks");
        losses.push(loss.item().unwrap());
    }
    assert!(losses[199] < 0.05 * losses[0], "{losses:?}");
    let predicted = model.forward(&x).argmax(-1, false).to_vec().unwrap();
    assert_eq!(predicted, vec![0, 1, 1, 0]);
}

#[test]
fn the_same_loop_marking_every_step_gives_the_same_parameters() {
    let (x, y) = xor();
    let run = |mark_every_step: bool| {
        let mut model = mlp(&Device::cpu());
        model.requires_grad();
        let mut opt = Sgd::new(SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..SgdConfig::default()
        });
        for _ in 0..20 {
            if mark_every_step {
                model.requires_grad();
            }
            let grads = loss_of(&model, &x, &y).backward().unwrap();
            opt.step(&mut model, &grads).unwrap();
        }
        let mut values = Vec::new();
        model.visit_params("", &mut |_, p| values.push(p.to_vec().unwrap()));
        values
    };
    assert_eq!(run(false), run(true));
}

#[test]
fn a_lazy_loop_marking_once_replays_one_trace() {
    let (x, y) = xor();
    let device = Device::lazy(&Device::cpu());
    let mut model = mlp(&device);
    model.requires_grad();
    let x = x.to_device(&device);
    let y = y.to_device(&device);
    let mut opt = Sgd::new(SgdConfig {
        lr: 0.1,
        ..SgdConfig::default()
    });
    lazy::mark_step();
    let mut losses = Vec::new();
    for _ in 0..6 {
        let loss = loss_of(&model, &x, &y);
        let grads = loss.backward().unwrap();
        opt.step(&mut model, &grads).unwrap();
        lazy::mark_step();
        losses.push(loss.item().unwrap());
    }
    assert!(losses[5] < losses[0], "{losses:?}");
    assert!(all_marked(&model));
}

#[test]
fn sub_assign_under_no_grad_keeps_the_mark() {
    let cpu = Device::cpu();
    let mut w = Tensor::<f32>::from_vec(vec![1.0, -2.0], &[2], &cpu)
        .unwrap()
        .requires_grad();
    for _ in 0..4 {
        let loss = (&w * &w).sum(&[0], false);
        let g = loss.backward().unwrap().get(&w).expect("w is marked");
        no_grad(|| w.sub_assign(&(&g * 0.25))).unwrap();
        assert!(w.is_requires_grad());
    }
    // w ← w − 0.25·2w halves w each step.
    assert_eq!(w.to_vec().unwrap(), vec![0.0625, -0.125]);
}

#[test]
fn assign_keeps_the_mark_and_checks_shape_and_history() {
    let cpu = Device::cpu();
    let mut w = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[2], &cpu)
        .unwrap()
        .requires_grad();
    let line = line!() + 1;
    let e = w.assign(Tensor::zeros(&[3], &cpu)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Shape);
    let text = e.to_string();
    assert!(text.contains("assign"), "{text}");
    assert!(text.contains(&format!("parameters.rs:{line}")), "{text}");
    assert!(text.contains("[3]") && text.contains("[2]"), "{text}");

    // Computed with gradients recorded: the parameter would depend on its
    // old self.
    let step = &w * 0.5;
    let line = line!() + 1;
    let e = w.sub_assign(&step).unwrap_err().to_string();
    assert!(e.contains("sub_assign") && e.contains("no_grad"), "{e}");
    assert!(e.contains(&format!("parameters.rs:{line}")), "{e}");
    assert_eq!(
        w.to_vec().unwrap(),
        vec![1.0, 2.0],
        "a failed update changes nothing"
    );

    let fresh = Tensor::<f32>::from_vec(vec![5.0, 6.0], &[2], &cpu).unwrap();
    w.assign(fresh).unwrap();
    assert!(w.is_requires_grad());
    let g = (&w * &w).sum(&[0], false).backward().unwrap();
    assert_eq!(g.get(&w).unwrap().to_vec().unwrap(), vec![10.0, 12.0]);

    // A tensor that is not a parameter takes any value, history included.
    let mut h = Tensor::<f32>::zeros(&[2], &cpu);
    h.assign(&w * 2.0).unwrap();
    assert!(!h.is_requires_grad());
    let g = h.sum(&[0], false).backward().unwrap();
    assert_eq!(g.get(&w).unwrap().to_vec().unwrap(), vec![2.0, 2.0]);
}

#[test]
fn no_grad_records_nothing_and_nests() {
    let cpu = Device::cpu();
    let w = Tensor::<f32>::from_vec(vec![3.0], &[1], &cpu)
        .unwrap()
        .requires_grad();
    let y = no_grad(|| {
        assert!(!is_grad_enabled());
        no_grad(|| assert!(!is_grad_enabled()));
        assert!(
            !is_grad_enabled(),
            "an inner scope ends, the outer one holds"
        );
        &w * &w
    });
    assert!(is_grad_enabled());
    assert_eq!(y.to_vec().unwrap(), vec![9.0]);
    let e = y.backward().unwrap_err().to_string();
    assert!(e.contains("does not depend"), "{e}");
    // Recording resumes after the scope, also after a panic inside one.
    let _ = std::panic::catch_unwind(|| no_grad(|| panic!("inside no_grad")));
    assert!(is_grad_enabled());
    let g = (&w * &w).backward().unwrap();
    assert_eq!(g.get(&w).unwrap().to_vec().unwrap(), vec![6.0]);
}

#[test]
fn clearing_the_mark_freezes_a_parameter() {
    let cpu = Device::cpu();
    let mut model = Linear::new(2, 1, true, &mut Rng::new(1), &cpu);
    model.requires_grad();
    model.bias.as_ref().unwrap().clear_requires_grad();
    let x = Tensor::<f32>::ones(&[3, 2], &cpu);
    let grads = model.forward(&x).sum(&[], false).backward().unwrap();
    assert!(grads.get(&model.weight).is_some());
    assert!(grads.get(model.bias.as_ref().unwrap()).is_none());
    let before = model.bias.as_ref().unwrap().to_vec().unwrap();
    let mut opt = Sgd::new(SgdConfig {
        lr: 0.1,
        ..SgdConfig::default()
    });
    opt.step(&mut model, &grads).unwrap();
    assert_eq!(model.bias.as_ref().unwrap().to_vec().unwrap(), before);
    assert!(model.weight.is_requires_grad());
    assert!(!model.bias.as_ref().unwrap().is_requires_grad());
}

#[test]
fn loading_and_broadcasting_keep_the_marks() {
    let cpu = Device::cpu();
    let mut model = Linear::new(2, 3, true, &mut Rng::new(2), &cpu);
    let bytes = stagecraft::nn::save_to_bytes(&model, &Default::default()).unwrap();
    model.requires_grad();
    stagecraft::nn::load_from_bytes(&mut model, &bytes, "saved").unwrap();
    assert!(all_marked(&model));
    DataParallel::new(&model)
        .broadcast_parameters(&mut model)
        .unwrap();
    assert!(all_marked(&model));
}
