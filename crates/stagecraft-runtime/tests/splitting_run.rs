//! A graph run in order whose kernels split their work stays on the
//! calling thread, inside the run's arena (its own binary: profiling and
//! the allocation counters are process-wide).

use stagecraft_graph::{Function, Value};
use stagecraft_ops::{OpAttrs, ABS};
use stagecraft_runtime::executor::instantiate;
use stagecraft_runtime::profile;
use stagecraft_runtime::Device;
use stagecraft_tensor::{Buffer, DType, DenseHostTensor, HostTensor, Location, TensorMetadata};
use std::sync::Arc;

#[test]
fn a_run_with_a_splitting_kernel_stays_on_the_calling_thread() {
    // One large step: run in order (nothing to overlap), but its kernel
    // splits over the pool.
    const N: usize = 1 << 18;
    let meta = TensorMetadata::new(DType::F32, [N]);
    let mut f = Function::new("abs", vec![meta]);
    let at = Location::new("splitting_run.rs", 1, 1);
    let y = f
        .add_op(&ABS, &OpAttrs::new(), &[Value::Param(0)], at)
        .unwrap();
    f.results = vec![Value::node(y)];
    let exe = instantiate(Arc::new(f), Device::cpu()).unwrap();
    let values: Vec<f32> = (0..N).map(|i| i as f32 - 1000.0).collect();
    let arg =
        || -> Vec<HostTensor> { vec![DenseHostTensor::from_slice(&values, [N]).unwrap().into()] };
    for _ in 0..3 {
        exe.run(arg()).unwrap();
    }

    profile::set_enabled(true);
    profile::instant(profile::OP, "caller", vec![]);
    let input = arg();
    let before = Buffer::stats().allocations;
    let out = exe.run(input).unwrap();
    let allocated = Buffer::stats().allocations - before;
    profile::set_enabled(false);
    let events = profile::take_events();
    let caller = events.iter().find(|e| e.name == "caller").unwrap().thread;
    let kernel = events
        .iter()
        .find(|e| e.category == profile::KERNEL && e.name == "Abs")
        .unwrap();
    assert_eq!(kernel.thread, caller, "the kernel left the calling thread");

    // The kernel's output came from the run's arena, entered on the
    // calling thread.
    assert_eq!(allocated, 0);
    let HostTensor::Dense(out) = &out[0] else {
        panic!("a dense result")
    };
    let want: Vec<f32> = values.iter().map(|v| v.abs()).collect();
    assert_eq!(out.as_slice::<f32>().unwrap(), &want[..]);
}
