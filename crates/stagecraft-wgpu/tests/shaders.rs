//! Every shader the kernels generate compiles on `gpu:0` (lavapipe in CI):
//! each elementwise op's WGSL expression from its definition, pasted into
//! its loop, and the fixed kernels. A broken `wgsl:` entry in the op table
//! fails here, named, rather than at a user's first launch.

use stagecraft_wgpu::{compile, every_elementwise_shader, Gpu};

#[test]
fn every_generated_shader_compiles() {
    let gpu = Gpu::get(0).unwrap_or_else(|e| panic!("the GPU tests need gpu:0: {e}"));
    let shaders = every_elementwise_shader();
    assert!(shaders.len() >= 40, "{} shaders", shaders.len());
    for (name, source) in &shaders {
        compile(gpu, source).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    println!(
        "{} shaders compiled on {} ({})",
        shaders.len(),
        gpu.adapter_name(),
        gpu.driver()
    );
}

#[test]
fn a_missing_adapter_index_names_the_adapters_there_are() {
    let err = Gpu::get(4096).unwrap_err();
    assert!(err.to_string().contains("gpu:0 = "), "{err}");
}

#[test]
fn a_tensor_larger_than_the_device_binds_is_an_error_not_an_abort() {
    use stagecraft_tensor::{DType, Shape, TensorMetadata};
    let gpu = Gpu::get(0).unwrap_or_else(|e| panic!("the GPU tests need gpu:0: {e}"));
    // 2^40 f32 elements: more than any device binds or holds.
    let meta = TensorMetadata::new(DType::F32, Shape::new(&[1 << 20, 1 << 20]));
    let err = gpu.alloc(meta).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("larger than the largest buffer") || text.contains("out of memory"),
        "{text}"
    );
    // The device is still usable.
    let small = TensorMetadata::new(DType::F32, Shape::new(&[4]));
    assert!(gpu.alloc(small).is_ok());
}
