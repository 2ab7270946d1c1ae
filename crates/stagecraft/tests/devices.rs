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
