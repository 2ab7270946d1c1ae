//! cancel_execution() from another thread turns pending and later ops into
//! cancellation errors until restart(). (Its own test binary: cancellation
//! is process-wide.)

use stagecraft::{cancel_execution, restart, with_execution_mode, Device, ExecutionMode, Tensor};
use std::time::{Duration, Instant};

#[test]
fn cancellation_from_another_thread() {
    let cpu = Device::cpu();

    // Sync mode: a long loop on this thread sees the cancellation issued by
    // another thread, and every later op fails fast.
    let canceller = std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(50));
        cancel_execution();
    });
    let start = Instant::now();
    let mut x = Tensor::<f32>::ones(&[64, 64], &cpu);
    let mut cancelled_at = None;
    for i in 0..1_000_000 {
        x = (x.matmul(&Tensor::ones(&[64, 64], &cpu)) * 1e-3).tanh();
        if x.check().is_err() {
            cancelled_at = Some(i);
            break;
        }
    }
    canceller.join().unwrap();
    assert!(cancelled_at.is_some(), "cancellation reached the loop");
    assert!(start.elapsed() < Duration::from_secs(20));
    let err = x.to_vec().unwrap_err();
    assert!(err.is_cancelled(), "{err}");
    let after = Tensor::<f32>::ones(&[2], &cpu) + 1.0;
    assert!(after.to_vec().unwrap_err().is_cancelled());

    restart();
    let ok = Tensor::<f32>::ones(&[2], &cpu) + 1.0;
    assert_eq!(ok.to_vec().unwrap(), vec![2.0, 2.0]);

    // Async mode: ops queued behind slow work are cancelled before running.
    let result = with_execution_mode(ExecutionMode::Async, || {
        let big = Tensor::<f32>::ones(&[384, 384], &cpu);
        let mut y = big.clone();
        for _ in 0..400 {
            y = (y.matmul(&big) * 1e-3).tanh();
        }
        y
    });
    cancel_execution();
    let err = result.to_vec().unwrap_err();
    assert!(err.is_cancelled(), "{err}");
    restart();
    let ok = with_execution_mode(ExecutionMode::Async, || {
        Tensor::<f32>::ones(&[3], &cpu) * 3.0
    });
    assert_eq!(ok.to_vec().unwrap(), vec![3.0; 3]);
}
