//! The fused elementwise kernel's generated WGSL compiles on `gpu:0` for a
//! program holding every op a fused program can run on the GPU, read
//! through every broadcast mode; and so do the indexing kernels' shaders.

use stagecraft_ops::{
    BinaryOp, DTypeClass, FusedInstr, FusedOperand, UnaryOp, FUSED_BINARY, FUSED_COMPARE,
    FUSED_UNARY,
};
use stagecraft_wgpu::{compile, every_indexing_shader, fused_shader, Gpu};

fn gpu() -> &'static Gpu {
    Gpu::get(0).unwrap_or_else(|e| panic!("the GPU tests need gpu:0: {e}"))
}

/// Every unary op with a WGSL form in a chain over input 0, then every
/// binary op and every comparison against inputs 1, 2 and 3 in turn.
fn program_of_every_op() -> (Vec<FusedInstr>, usize) {
    let inputs = 4;
    let mut program = Vec::new();
    let last = |program: &Vec<FusedInstr>| inputs + program.len() - 1;
    let float = |class: DTypeClass| class.accepts(stagecraft_tensor::DType::F32);
    for &op in FUSED_UNARY {
        if op.wgsl().is_some() && float(op.class()) {
            let a = if program.is_empty() {
                0
            } else {
                last(&program)
            };
            program.push(FusedInstr::Unary(op, a));
        }
    }
    let unary = program.len();
    for (k, &op) in FUSED_BINARY.iter().enumerate() {
        if op.wgsl().is_some() && float(op.class()) {
            program.push(FusedInstr::Binary(op, last(&program), 1 + k % 3));
        }
    }
    let binary = program.len() - unary;
    for (k, &op) in FUSED_COMPARE.iter().enumerate() {
        program.push(FusedInstr::Compare(op, 1 + k % 3, last(&program)));
    }
    // The counts of ops with a WGSL form: losing one shows here.
    assert!(unary >= 25 && binary >= 7, "{unary} unary, {binary} binary");
    (program, inputs)
}

#[test]
fn a_fused_program_of_every_op_compiles_in_every_read_mode() {
    let gpu = gpu();
    let (program, inputs) = program_of_every_op();
    assert_eq!(inputs, 4);
    let modes = [
        FusedOperand::Full,
        FusedOperand::Tile { period: 3 },
        FusedOperand::Repeat { run: 5 },
        FusedOperand::Scalar,
    ];
    let source = fused_shader(&program, &modes).expect("every op here has a WGSL form");
    compile(gpu, &source).unwrap_or_else(|e| panic!("{e}"));
    // Each op's function is defined once, however often it is used.
    assert_eq!(source.matches("fn u_Exp(").count(), 1, "{source}");
    // Shapes live in `params`: other periods and runs give the same
    // source, so one pipeline serves every shape.
    let other = [
        FusedOperand::Full,
        FusedOperand::Tile { period: 7 },
        FusedOperand::Repeat { run: 2 },
        FusedOperand::Scalar,
    ];
    assert_eq!(fused_shader(&program, &other).as_deref(), Some(&*source));
    println!(
        "{} instructions compiled on {} ({})",
        program.len(),
        gpu.adapter_name(),
        gpu.driver()
    );
}

#[test]
fn a_fused_program_binds_only_the_inputs_it_reads() {
    // x1 is never read: x0 and x2 take bindings 0 and 1.
    let program = [
        FusedInstr::Binary(BinaryOp::Mul, 0, 2),
        FusedInstr::Unary(UnaryOp::Tanh, 3),
    ];
    let modes = [FusedOperand::Full; 3];
    let source = fused_shader(&program, &modes).unwrap();
    assert!(
        source.contains("@binding(1) var<storage, read> x2"),
        "{source}"
    );
    assert!(!source.contains("x1"), "{source}");
    assert!(source.contains("@binding(2) var<storage, read_write> output"));
    compile(gpu(), &source).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn programs_the_gpu_cannot_run_have_no_shader() {
    let full = [FusedOperand::Full];
    // Logical not's WGSL form is over 0/1 integers, not a float program's
    // f32s: the CPU's kernel runs the program.
    assert!(UnaryOp::Not.wgsl().is_some());
    assert_eq!(
        fused_shader(&[FusedInstr::Unary(UnaryOp::Not, 0)], &full),
        None
    );
    assert_eq!(fused_shader(&[], &full), None);
    // A register read before it is written.
    assert_eq!(
        fused_shader(&[FusedInstr::Binary(BinaryOp::Add, 0, 1)], &full),
        None
    );
}

#[test]
fn every_indexing_shader_compiles() {
    let gpu = gpu();
    let shaders = every_indexing_shader();
    assert!(shaders.len() >= 17, "{} shaders", shaders.len());
    for (name, source) in &shaders {
        compile(gpu, source).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}
