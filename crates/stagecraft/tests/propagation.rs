//! An op whose input is an error runs no kernel. (Its own test binary: the
//! kernel-launch counter is process-wide.)

use stagecraft::layers::runtime::stats;
use stagecraft::{Device, Tensor};

#[test]
fn errors_skip_kernels_downstream() {
    let cpu = Device::cpu();
    let a = Tensor::<f32>::ones(&[2, 3], &cpu);
    let b = Tensor::<f32>::ones(&[4, 5], &cpu);

    let before = stats();
    let good = (&a * 2.0).exp();
    good.wait().unwrap();
    let ran = stats().kernel_launches - before.kernel_launches;
    assert_eq!(ran, 2, "a healthy chain launches one kernel per op");

    let before = stats();
    let bad = a.matmul(&b);
    let mut t = bad.clone();
    for _ in 0..10 {
        t = (t.relu() + 1.0).sum(&[0], true);
    }
    assert!(t.to_vec().is_err());
    let after = stats();
    assert_eq!(
        after.kernel_launches, before.kernel_launches,
        "no kernel ran for failed ops"
    );
    assert_eq!(after.ops_executed - before.ops_executed, 31);
    assert_eq!(
        after.errors_raised - before.errors_raised,
        1,
        "raised once, propagated 30 times"
    );
    assert!(t.check().unwrap_err().op() == Some("MatMul"));
}
