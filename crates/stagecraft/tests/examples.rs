//! Runs every program in `examples/` as part of the test suite, so an
//! example that compiles but fails (an error, a panic) fails CI. Each
//! example file is compiled here as a module whose `pub fn main` is called.

#[path = "../examples/control_flow.rs"]
mod control_flow;
#[path = "../examples/eager.rs"]
mod eager;
#[path = "../examples/function.rs"]
mod function;
#[path = "../examples/grad.rs"]
mod grad;
#[path = "../examples/lazy.rs"]
mod lazy;
#[path = "../examples/staging.rs"]
mod staging;

#[test]
fn eager_example_runs() {
    eager::main().unwrap();
}

#[test]
fn lazy_example_runs() {
    lazy::main().unwrap();
}

#[test]
fn function_example_runs() {
    function::main().unwrap();
}

#[test]
fn control_flow_example_runs() {
    control_flow::main().unwrap();
}

#[test]
fn grad_example_runs() {
    grad::main().unwrap();
}

#[test]
fn staging_example_runs() {
    staging::main().unwrap();
}
