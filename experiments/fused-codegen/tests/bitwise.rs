//! The generated code gives the interpreter's bits: on the B3 chain, on a
//! tree using every supported op, and on a 100-instruction program; over
//! data with NaNs, signed zeros and infinities; at sizes that leave a
//! scalar tail and that take the parallel path.

use fused_codegen::interp::Interpreter;
use fused_codegen::jit::{JitKernel, Options};
use fused_codegen::programs::{self, Workload};

fn bits(t: &stagecraft_tensor::DenseHostTensor) -> Vec<u32> {
    t.as_slice::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn same_bits(w: &Workload) {
    for n in [1, 3, 4, 7, 1000, 1003, 70_001] {
        for specials in [false, true] {
            let inputs = w.tensors(n, specials).unwrap();
            let metas = w.metas(n);
            let want = Interpreter::new(&w.program, &metas)
                .unwrap()
                .run(&inputs)
                .unwrap();
            if !specials && n >= 1000 {
                // Ordinary data gives ordinary results: the comparison is
                // not between two arrays of NaNs or infinities.
                let v = want.as_slice::<f32>().unwrap();
                let finite = v.iter().filter(|x| x.is_finite() && **x != 0.0).count();
                assert!(finite > n / 2, "{}: only {finite} of {n} finite", w.name);
            }
            for unroll in [1, 2, 4] {
                let options = Options {
                    unroll,
                    verify: true,
                };
                let got = JitKernel::new(&w.program, &metas, options)
                    .unwrap()
                    .run(&inputs)
                    .unwrap();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{}: n = {n}, specials = {specials}, unroll = {unroll}",
                    w.name
                );
            }
        }
    }
}

#[test]
fn b3_chain() {
    same_bits(&programs::b3());
}

#[test]
fn tree_with_every_supported_op() {
    same_bits(&programs::tree());
}

#[test]
fn hundred_instructions() {
    same_bits(&programs::long(100));
}

/// The special values really occur in the results, so the NaN and signed
/// zero cases above are exercised rather than washed out.
#[test]
fn specials_reach_the_output() {
    let w = programs::tree();
    let inputs = w.tensors(1000, true).unwrap();
    let out = Interpreter::new(&w.program, &w.metas(1000))
        .unwrap()
        .run(&inputs)
        .unwrap();
    let v = out.as_slice::<f32>().unwrap();
    assert!(v.iter().any(|x| x.is_nan()));
    assert!(v.iter().any(|x| x.is_infinite()));
}

#[test]
fn unsupported_ops_are_refused() {
    let program = vec![programs::unary(stagecraft_ops::UnaryOp::Tanh), 0, 0];
    let metas = programs::b3().metas(10)[..1].to_vec();
    assert!(JitKernel::new(&program, &metas, Options::default()).is_err());
}
