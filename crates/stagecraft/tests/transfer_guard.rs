//! Transfer guards: implicit device-to-host copies are counted, logged
//! with their source line or refused; explicit copies always pass.

use stagecraft::{
    take_transfer_log, transfer_guard, transfer_stats, Device, Tensor, TransferGuard,
};

fn f32s(values: &[f32]) -> Tensor<f32> {
    Tensor::from_vec(values.to_vec(), &[values.len()], &Device::cpu()).unwrap()
}

#[test]
fn log_names_the_copy_and_the_line() {
    let x = f32s(&[1.0, 2.0]);
    let before = transfer_stats();
    let line = line!() + 1;
    let values = transfer_guard(TransferGuard::Log, || x.to_vec().unwrap());
    assert_eq!(values, vec![1.0, 2.0]);
    let log = take_transfer_log();
    assert_eq!(log.len(), 1, "{log:?}");
    assert!(
        log[0].contains("to_vec") && log[0].contains("f32[2]"),
        "{log:?}"
    );
    assert!(
        log[0].contains(&format!("transfer_guard.rs:{line}:")),
        "{log:?}"
    );
    let after = transfer_stats();
    assert!(after.implicit > before.implicit && after.logged > before.logged);
}

#[test]
fn disallow_refuses_implicit_copies_with_an_error_naming_them() {
    let x = f32s(&[1.0, 2.0]);
    let line = line!() + 1;
    let err = transfer_guard(TransferGuard::Disallow, || x.item()).unwrap_err();
    assert_eq!(err.op(), Some("item"), "{err}");
    assert_eq!(err.location().unwrap().line(), line, "{err}");
    assert!(
        err.to_string().contains("to_host"),
        "says what to do: {err}"
    );
    let printed = transfer_guard(TransferGuard::Disallow, || format!("{x}"));
    assert!(
        printed.contains("Display") && printed.contains("disallowed"),
        "{printed}"
    );
    // Guards nest and end with their scope.
    transfer_guard(TransferGuard::Disallow, || {
        transfer_guard(TransferGuard::Allow, || assert!(x.to_vec().is_ok()));
        assert!(x.to_vec().is_err());
    });
    assert!(x.to_vec().is_ok());
}

#[test]
fn explicit_copies_always_pass() {
    let x = f32s(&[3.0]);
    let before = transfer_stats();
    transfer_guard(TransferGuard::Disallow, || {
        let host = x.to_host();
        assert_eq!(host.device(), Device::host());
        assert_eq!(host.to_vec().unwrap(), vec![3.0]);
        assert_eq!(
            (&host * 2.0).item().unwrap(),
            6.0,
            "ops run on the host too"
        );
        let other = x.to_device(&Device::parse("cpu:1").unwrap());
        assert_eq!(other.to_host().item().unwrap(), 3.0);
    });
    assert!(transfer_stats().explicit >= before.explicit + 3);
}

#[stagecraft::stage]
fn reads_a_device_value(x: Tensor<f32>) -> Tensor<f32> {
    let bias = Tensor::<f32>::scalar(2.0, &Device::cpu());
    let b = bias.item().unwrap_or(-1.0);
    &x + b
}

#[test]
fn reads_inside_staged_code_are_guarded() {
    let x = f32s(&[1.0]);
    let out = transfer_guard(TransferGuard::Disallow, || reads_a_device_value(x.clone()));
    // The refused read fell back to -1 while tracing.
    assert_eq!(out.to_vec().unwrap(), vec![0.0]);
    let log = transfer_guard(TransferGuard::Log, || {
        let _ = take_transfer_log();
        reads_a_device_value(f32s(&[1.0, 2.0]));
        take_transfer_log()
    });
    assert_eq!(log.len(), 1, "one trace for the new signature: {log:?}");
    assert!(log[0].contains("inside staged code"), "{log:?}");
    assert!(log[0].contains("transfer_guard.rs:"), "{log:?}");
}
