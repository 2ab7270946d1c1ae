//! A staged function whose halves run on two (virtual CPU) devices:
//! placement, partitioning with Send/Recv through a rendezvous, and errors.

use stagecraft::layers::runtime::{self as rt, executor};
use stagecraft::{function, with_device, Device, Rng, Tensor};

fn model(
    x: &Tensor<f32>,
    w1: &Tensor<f32>,
    w2: &Tensor<f32>,
    second: Option<Device>,
) -> Tensor<f32> {
    let h = x.matmul(w1).relu();
    let tail = || (h.matmul(w2) + 0.5).tanh();
    let out = match second {
        Some(d) => with_device(&d, tail),
        None => tail(),
    };
    out.sum(&[-1], false)
}

#[test]
fn two_halves_on_two_devices_match_one_device() {
    let cpu = Device::cpu();
    let cpu1 = Device::parse("cpu:1").unwrap();
    let mut rng = Rng::new(9);
    let x = Tensor::<f32>::rand_normal(&[8, 32], 0.0, 1.0, &mut rng, &cpu);
    let w1 = Tensor::<f32>::rand_normal(&[32, 64], 0.0, 0.2, &mut rng, &cpu);
    let w2 = Tensor::<f32>::rand_normal(&[64, 16], 0.0, 0.2, &mut rng, &cpu);
    let single = model(&x, &w1, &w2, None).to_vec().unwrap();
    let split = function(
        move |(x, w1, w2): (Tensor<f32>, Tensor<f32>, Tensor<f32>)| model(&x, &w1, &w2, Some(cpu1)),
    );
    let copies = rt::stats().device_copies;
    let got = split
        .call((x.clone(), w1.clone(), w2.clone()))
        .to_vec()
        .unwrap();
    assert_eq!(got, single);
    assert!(
        rt::stats().device_copies >= copies + 3,
        "h, w2 and the result cross devices"
    );
    let traced = split.traced_function(&(x, w1, w2)).unwrap();
    assert!(traced
        .nodes
        .iter()
        .any(|n| n.device.as_deref() == Some("cpu:1")));
    let exe = executor::instantiate(traced, cpu).unwrap();
    assert_eq!(exe.partition_count(), 2);
}

#[test]
fn an_error_on_one_device_stops_the_other() {
    let cpu = Device::cpu();
    let cpu1 = Device::parse("cpu:1").unwrap();
    let line = line!() + 4;
    let f = function(move |x: Tensor<i32>| {
        let zeros = &x - &x;
        let far = with_device(&cpu1, || {
            let q = &x / &zeros;
            q * 2
        });
        // cpu:0 waits for `far`; the error on cpu:1 must release it.
        (&x + 1) + far
    });
    let err = f
        .call(Tensor::<i32>::ones(&[64], &cpu))
        .to_vec()
        .unwrap_err();
    assert_eq!(err.op(), Some("Div"), "{err}");
    assert_eq!(err.location().unwrap().line(), line, "{err}");
}

#[test]
fn a_function_on_devices_of_rank_0_runs_in_a_single_process() {
    // A process without a distributed group is rank 0 of 1, so a function
    // written for ranks runs unchanged when all its ranks are 0.
    let cpu = Device::cpu();
    let far = Device::parse("/rank:0/cpu:1").unwrap();
    let mut rng = Rng::new(5);
    let x = Tensor::<f32>::rand_normal(&[4, 16], 0.0, 1.0, &mut rng, &cpu);
    let w1 = Tensor::<f32>::rand_normal(&[16, 8], 0.0, 0.3, &mut rng, &cpu);
    let w2 = Tensor::<f32>::rand_normal(&[8, 4], 0.0, 0.3, &mut rng, &cpu);
    let single = model(&x, &w1, &w2, None).to_vec().unwrap();
    let split = function(
        move |(x, w1, w2): (Tensor<f32>, Tensor<f32>, Tensor<f32>)| model(&x, &w1, &w2, Some(far)),
    );
    for _ in 0..2 {
        let got = split
            .call((x.clone(), w1.clone(), w2.clone()))
            .to_vec()
            .unwrap();
        assert_eq!(got, single);
    }
}

#[test]
fn a_rank_beyond_the_group_is_an_error_naming_the_line() {
    let cpu = Device::cpu();
    let far = Device::parse("/rank:1/cpu:0").unwrap();
    let line = line!() + 2;
    let f = function(move |x: Tensor<f32>| {
        let y = with_device(&far, || x.exp());
        y + 1.0
    });
    let err = f
        .call(Tensor::<f32>::ones(&[3], &cpu))
        .to_vec()
        .unwrap_err();
    assert_eq!(err.kind(), stagecraft::ErrorKind::Device, "{err}");
    assert!(
        err.to_string()
            .contains("/rank:1/cpu:0, but the group has 1 process"),
        "{err}"
    );
    assert_eq!(err.location().unwrap().line(), line, "{err}");
}

#[test]
fn eager_ops_on_another_process_device_are_errors() {
    let far = Device::parse("/rank:1/cpu:0").unwrap();
    let line = line!() + 1;
    let err = Tensor::<f32>::ones(&[3], &far).to_vec().unwrap_err();
    assert_eq!(err.kind(), stagecraft::ErrorKind::Device, "{err}");
    assert!(
        err.to_string().contains("device of another process"),
        "{err}"
    );
    assert_eq!(err.location().unwrap().line(), line, "{err}");
    let here = Tensor::<f32>::ones(&[3], &Device::cpu());
    let err = here.to_device(&far).to_vec().unwrap_err();
    assert!(
        err.to_string().contains("device of another process"),
        "{err}"
    );
    // This process's own rank is an ordinary CPU device.
    let own = Device::parse("/rank:0/cpu:0").unwrap();
    let y = Tensor::<f32>::ones(&[3], &own) * 2.0f32;
    assert_eq!(y.to_vec().unwrap(), vec![2.0; 3]);
}
