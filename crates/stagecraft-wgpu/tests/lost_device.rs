//! After the device is lost (here: marked lost as wgpu's callback does),
//! allocations, launches and downloads are errors that say so; nothing
//! panics or hangs. Its own test binary: the loss is permanent for the
//! process.

use stagecraft_ops::{defs, Attrs, OpAttrs};
use stagecraft_tensor::{DType, DenseHostTensor, Shape, TensorMetadata};
use stagecraft_wgpu::{run, Gpu};

#[test]
fn a_lost_device_turns_every_operation_into_an_error() {
    let gpu = Gpu::get(0).unwrap_or_else(|e| panic!("the GPU tests need gpu:0: {e}"));
    let host = DenseHostTensor::from_slice(&[1.0f32, 2.0], [2]).unwrap();
    let x = gpu.upload(&host).unwrap();
    gpu.simulate_loss("a test");
    let meta = TensorMetadata::new(DType::F32, Shape::new(&[2]));
    let attrs = OpAttrs::new();
    let launched = run(
        gpu,
        &defs::EXP,
        &Attrs::new(&attrs, &defs::EXP),
        &[&x],
        std::slice::from_ref(&meta),
    );
    for err in [
        launched.map(|_| ()).unwrap_err(),
        gpu.download(&x).map(|_| ()).unwrap_err(),
        gpu.alloc(meta).map(|_| ()).unwrap_err(),
        gpu.upload(&host).map(|_| ()).unwrap_err(),
    ] {
        assert!(err.to_string().contains("gpu:0 was lost (a test)"), "{err}");
    }
}
