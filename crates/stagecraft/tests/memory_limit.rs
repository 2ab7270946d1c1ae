//! The host memory cap (`Buffer::set_memory_limit`). One test in its own
//! process: the cap is process-wide, and a test beside it would see it.

use stagecraft::layers::tensor::Buffer;
use stagecraft::{Device, Tensor};

#[test]
fn tensors_past_the_memory_limit_are_errors_of_their_ops() {
    const MIB: u64 = 1 << 20;
    for device in [Device::cpu(), Device::lazy(&Device::cpu())] {
        Buffer::set_memory_limit(Some(64 * MIB));
        assert_eq!(Buffer::memory_limit(), Some(64 * MIB));
        let small = Tensor::<f32>::full(&[1 << 20], 1.0, &device) + 1.0;
        assert_eq!(small.to_vec().unwrap().len(), 1 << 20);
        // 128 MiB of f32: one op's output alone passes the cap.
        let big = Tensor::<f32>::full(&[1 << 25], 1.0, &device);
        let line = line!() + 1;
        let err = (&big * 2.0).to_vec().unwrap_err();
        assert_eq!(err.op(), Some("Mul"), "{err}");
        assert_eq!(err.location().map(|l| l.line()), Some(line), "{err}");
        assert!(err.to_string().contains("does not fit in memory"), "{err}");
        // Without the cap the same program runs.
        Buffer::set_memory_limit(None);
        assert_eq!(Buffer::memory_limit(), None);
        let doubled = (&big * 2.0).sum(&[0], false).to_vec().unwrap();
        assert_eq!(doubled, vec![2.0 * (1 << 25) as f32]);
        drop(small);
    }
}
