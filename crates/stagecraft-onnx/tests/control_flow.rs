//! The node suite's control-flow cases (`If`, `Loop`, `Scan`) in every
//! mode: the functional `If`/`While` ops agree eagerly, lazily and staged.

use stagecraft_onnx::conformance::{self, Outcome};
use stagecraft_onnx::Mode;
use std::path::PathBuf;

#[test]
fn control_flow_cases() {
    if std::env::var_os("STAGECRAFT_ONNX_SKIP_CONFORMANCE").is_some() {
        eprintln!("SKIPPED: STAGECRAFT_ONNX_SKIP_CONFORMANCE is set");
        return;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/onnx");
    let root = conformance::data_dir(None, &root);
    conformance::ensure_data(&root).expect("the ONNX conformance data");
    let cases = conformance::cases(&root, "node").expect("the node suite");
    let mut outcomes = Vec::new();
    for case in cases.iter().filter(|c| {
        ["test_if", "test_loop", "test_scan"]
            .iter()
            .any(|p| c.id.starts_with(&format!("node/{p}")))
    }) {
        for mode in [Mode::Function, Mode::Eager, Mode::Lazy] {
            let r = conformance::run_case(case, mode);
            eprintln!("{} {mode:?}: {:?}", case.id, r.outcome);
            outcomes.push((case.id.clone(), mode, r.outcome));
        }
    }
    for name in ["node/test_if", "node/test_scan9_sum"] {
        for (n, mode, o) in &outcomes {
            if n == name {
                assert_eq!(*o, Outcome::Pass, "{n} {mode:?}");
            }
        }
    }
}
