//! `STAGECRAFT_LAZY_EAGER=1` makes lazy devices run op by op (its own
//! binary: the variable is read when the device is created).

use stagecraft::{lazy, Device, Tensor};

#[test]
fn lazy_devices_run_op_by_op_when_asked() {
    std::env::set_var("STAGECRAFT_LAZY_EAGER", "1");
    let d = Device::lazy(&Device::cpu());
    lazy::reset_metrics();
    let x = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[2], &d).unwrap();
    let y = (&x * 3.0).exp().log();
    assert_eq!(y.device(), d);
    // Already computed: there is no pending trace to print.
    assert!(lazy::trace_text(&y).is_err());
    let got = y.to_vec().unwrap();
    assert!(
        (got[0] - 3.0).abs() < 1e-6 && (got[1] - 6.0).abs() < 1e-6,
        "{got:?}"
    );
    let m = lazy::metrics();
    assert_eq!((m.ops_recorded, m.materializations), (0, 0), "{m:?}");
}
