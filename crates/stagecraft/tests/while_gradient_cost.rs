//! The gradient of a While costs one backward body per forward iteration:
//! the forward loop stacks what the backward needs, so the work grows
//! linearly with the trip count (recomputing each iteration's state from
//! the start would grow quadratically). Its own test binary: it reads the
//! process-wide kernel-launch counter.

use stagecraft::layers::runtime;
use stagecraft::{Device, Tensor};

type T = Tensor<f64>;

/// Kernel launches of one eager forward + backward through a loop of
/// `trips` iterations (the trip count depends on the data).
fn launches(trips: i64) -> u64 {
    let cpu = Device::cpu();
    let x = T::from_vec(vec![0.5, -0.25], &[2], &cpu)
        .unwrap()
        .requires_grad();
    let n = Tensor::<i64>::scalar(trips, &cpu);
    let before = runtime::stats().kernel_launches;
    let (y, _) = stagecraft::while_loop(
        (x.clone(), Tensor::<i64>::scalar(0, &cpu)),
        |(_, i)| i.lt(&n),
        |(x, i)| ((&x * 1.01).sin() + 0.1, i + 1),
    );
    let g = y.sum(&[0], false).backward().unwrap().get(&x).unwrap();
    g.to_vec().unwrap();
    runtime::stats().kernel_launches - before
}

#[test]
fn while_gradient_work_is_linear_in_the_trip_count() {
    launches(3); // instantiate everything once
    let short = launches(20);
    let long = launches(80);
    // Linear: about 4x; recomputation would be about 16x.
    let ratio = long as f64 / short as f64;
    assert!(
        ratio < 5.0,
        "80 trips took {long} kernel launches, 20 trips {short} (ratio {ratio:.1})"
    );
}
