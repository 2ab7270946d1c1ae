//! Cancellation from another thread stops a staged While that would never
//! end (its own binary: cancellation is process-wide).

use stagecraft::layers::runtime as rt;
use stagecraft::{while_loop, Device, Tensor};

#[test]
fn cancelling_stops_a_long_while_loop() {
    let cpu = Device::cpu();
    let worker = std::thread::spawn(move || {
        // Never terminates on its own.
        let out = while_loop(
            Tensor::<f32>::scalar(0.0, &cpu),
            |x| x.ge(&Tensor::scalar(0.0, &cpu)),
            |x| x + 1.0,
        );
        out.to_vec()
    });
    std::thread::sleep(std::time::Duration::from_millis(100));
    rt::cancel_execution();
    let result = worker.join().unwrap();
    rt::restart();
    let err = result.unwrap_err();
    assert_eq!(err.kind(), stagecraft::ErrorKind::Cancelled, "{err}");
}
