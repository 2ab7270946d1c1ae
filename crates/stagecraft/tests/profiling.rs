//! The profiling hooks and `lazy::step_trace`: what the `stagecraft`
//! command's `--profile` and `trace` build on. One test per concern, run
//! one at a time, since profiling and the lazy runtime are process-wide.

use stagecraft::layers::graph::NodeOp;
use stagecraft::layers::runtime::profile;
use stagecraft::{lazy, Device, Tensor};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

/// One SGD step of `w` on a lazy device, left pending.
fn pending_step(w: &Tensor<f32>, x: &Tensor<f32>) -> (Tensor<f32>, Tensor<f32>) {
    let tracked = w.requires_grad();
    let loss = (x.matmul(&tracked).tanh() * 2.0 + 1.0).sum(&[], false);
    let g = loss.backward().unwrap().get(&tracked).unwrap();
    // The update under no_grad, as optimizers make it: recorded, it would
    // keep `g * 0.1` alive on the tape as a third live output.
    (stagecraft::no_grad(|| &tracked - &(g * 0.1)), loss)
}

#[test]
fn every_hook_records_its_kind_of_event() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cpu = Device::cpu();
    let dev = Device::lazy(&cpu);
    profile::set_enabled(true);
    // Eager: an op kernel and a read to the host.
    let eager = Tensor::<f32>::ones(&[4], &cpu).exp();
    eager.to_vec().unwrap();
    // Lazy: two equal steps, a miss with a compile, then a hit.
    let x = Tensor::<f32>::ones(&[2, 3], &dev);
    let mut w = Tensor::<f32>::full(&[3, 2], 0.5, &dev);
    lazy::mark_step();
    for _ in 0..3 {
        let (next, loss) = pending_step(&w, &x);
        w = next;
        lazy::mark_step();
        loss.item().unwrap();
    }
    profile::set_enabled(false);
    let events = profile::take_events();
    let count = |cat: &str| events.iter().filter(|e| e.category == cat).count();
    assert!(count(profile::OP) >= 1, "{events:#?}");
    assert!(count(profile::KERNEL) >= 3, "{events:#?}");
    assert!(count(profile::COMPILE) >= 1, "{events:#?}");
    assert!(count(profile::MATERIALIZE) >= 3, "{events:#?}");
    assert!(count(profile::TRANSFER) >= 4, "{events:#?}");
    assert!(events.iter().any(|e| e.name == "cache miss"));
    assert!(events.iter().any(|e| e.name == "cache hit"));
    let read = events
        .iter()
        .find(|e| e.category == profile::TRANSFER)
        .unwrap();
    assert_eq!(read.args, vec![("bytes", "16".to_string())]);
    assert!(events.windows(2).all(|p| p[0].start_us <= p[1].start_us));
    // Off again: nothing more is recorded.
    Tensor::<f32>::ones(&[4], &cpu).exp().to_vec().unwrap();
    assert!(profile::take_events().is_empty());
}

#[test]
fn step_trace_shows_the_pending_step_without_running_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dev = Device::lazy(&Device::cpu());
    // Larger than the bake limit, so the inputs stay arguments and
    // constant folding cannot fold the whole step away.
    let x = Tensor::<f32>::ones(&[8, 16], &dev);
    let w = Tensor::<f32>::full(&[16, 8], 0.5, &dev);
    lazy::mark_step();
    let (next, loss) = pending_step(&w, &x);
    let before = lazy::metrics().materializations;
    let step = lazy::step_trace().unwrap();
    assert_eq!(
        lazy::metrics().materializations,
        before,
        "step_trace ran a trace"
    );
    // The live outputs: the new weights and the loss.
    assert_eq!(step.recorded.results.len(), 2);
    assert_eq!(step.optimized.results.len(), 2);
    assert!(step.optimized.nodes.len() < step.recorded.nodes.len());
    let fused = step
        .optimized
        .nodes
        .iter()
        .any(|n| matches!(&n.op, NodeOp::Op(def, _) if def.name == "FusedElementwise"));
    assert!(
        fused,
        "{}",
        stagecraft::layers::graph::text::print(&step.optimized)
    );
    // The step still runs as usual, and afterwards nothing is pending.
    lazy::mark_step();
    assert!(loss.item().unwrap().is_finite());
    assert_eq!(next.dims(), &[16, 8]);
    let e = lazy::step_trace().unwrap_err().to_string();
    assert!(e.contains("no live lazy tensor is pending"), "{e}");
}
