//! Generates the ONNX protobuf types from the vendored `proto/onnx.proto`
//! with protox (a pure-Rust protobuf compiler) and prost-build.

fn main() {
    println!("cargo:rerun-if-changed=proto/onnx.proto");
    let fds = match protox::compile(["onnx.proto"], ["proto"]) {
        Ok(fds) => fds,
        Err(e) => panic!("cannot compile proto/onnx.proto: {e}"),
    };
    if let Err(e) = prost_build::Config::new().compile_fds(fds) {
        panic!("cannot generate Rust code from proto/onnx.proto: {e}");
    }
}
