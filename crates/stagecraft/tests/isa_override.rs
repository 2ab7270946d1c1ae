//! `STAGECRAFT_CPU_ISA` lowers the instruction set the CPU kernels use,
//! for the whole process: this test runs its own binary again with the
//! variable set, and compares what the kernels compute there (and which
//! level they report) with this process's results.

use stagecraft::layers::cpu::isa::{self, IsaLevel};
use stagecraft::{Device, Tensor};

/// A product, a fused elementwise chain, a softmax and a reduction, on the
/// eager and lazy devices: the kernels with vector loops.
fn workload() -> Vec<f32> {
    let cpu = Device::cpu();
    let mut out = Vec::new();
    for device in [cpu, Device::lazy(&cpu)] {
        let a: Vec<f32> = (0..64 * 96)
            .map(|i| ((i * 7) % 31) as f32 / 31.0 - 0.5)
            .collect();
        let b: Vec<f32> = (0..96 * 80)
            .map(|i| ((i * 5) % 29) as f32 / 29.0 - 0.5)
            .collect();
        let a = Tensor::from_vec(a, &[64, 96], &device).unwrap();
        let b = Tensor::from_vec(b, &[96, 80], &device).unwrap();
        let y = a.matmul(&b);
        let z = ((&y * 2.0 + 1.0).exp() - &y).tanh();
        let s = z.softmax(-1).sum(&[0], false);
        out.extend(y.to_vec().unwrap());
        out.extend(s.to_vec().unwrap());
    }
    out
}

const CHILD: &str = "child_prints_its_level_and_results";

/// Run by the test below in a process of its own, with the variable set.
#[test]
#[ignore = "run by forcing_avx2_keeps_the_results, in a child process with STAGECRAFT_CPU_ISA set"]
fn child_prints_its_level_and_results() {
    let values: Vec<String> = workload().iter().map(|v| v.to_string()).collect();
    println!("level={:?}", isa::level());
    println!("values={}", values.join(","));
}

#[test]
fn forcing_avx2_keeps_the_results() {
    if isa::detected() < IsaLevel::Avx2 {
        eprintln!("SKIPPED: this CPU has no AVX2, so there is no lower vector level to force");
        return;
    }
    let here = workload();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            CHILD,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(isa::ENV, "avx2")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let head: String = stdout.chars().take(400).collect();
    assert!(
        out.status.success(),
        "{head}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The harness prints the test's name on the line the first field
    // starts on.
    let field = |name: &str| {
        stdout
            .lines()
            .find_map(|l| l.split_once(name).map(|(_, value)| value))
            .unwrap_or_else(|| panic!("no {name} in {head}"))
            .to_string()
    };
    assert_eq!(field("level="), "Avx2");
    let there: Vec<f32> = field("values=")
        .split(',')
        .map(|v| v.parse().unwrap())
        .collect();
    assert_eq!(there.len(), here.len());
    // Other lanes sum in another order: equal within rounding, not bits.
    for (i, (a, b)) in here.iter().zip(&there).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
            "value {i}: {a} vs {b}"
        );
    }
}

#[test]
fn an_unreadable_setting_is_named_in_the_error() {
    let err = IsaLevel::parse("avx1024").unwrap_err();
    assert!(
        err.contains("STAGECRAFT_CPU_ISA") && err.contains("avx1024"),
        "{err}"
    );
}
