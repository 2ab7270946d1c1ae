//! The ONNX backend test suite (onnx 1.22.0's test data, fetched into
//! `data/onnx/` on first use): every case listed in
//! `conformance/expected_passes.txt` must still pass.
//!
//! Without network or pip the fetch fails and so does this test, with a
//! message saying how to get the data by hand; set
//! `STAGECRAFT_ONNX_SKIP_CONFORMANCE=1` to skip it visibly instead.
//! `STAGECRAFT_ONNX_WRITE_EXPECTED=1` rewrites the expected list and
//! `docs/onnx-conformance.md` from this run.

use stagecraft_onnx::conformance::{self, Outcome};
use stagecraft_onnx::Mode;
use std::collections::BTreeSet;
use std::path::PathBuf;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The data directory, fetched on first use (once, however many tests
/// ask at the same time); `None` when the suite is skipped (visibly).
fn data() -> Option<PathBuf> {
    static DATA: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    DATA.get_or_init(fetch_data).clone()
}

fn fetch_data() -> Option<PathBuf> {
    if std::env::var_os("STAGECRAFT_ONNX_SKIP_CONFORMANCE").is_some() {
        eprintln!("SKIPPED: the ONNX conformance suite (STAGECRAFT_ONNX_SKIP_CONFORMANCE is set)");
        return None;
    }
    let root = conformance::data_dir(None, &workspace().join("data/onnx"));
    if let Err(e) = conformance::ensure_data(&root) {
        panic!(
            "the ONNX conformance data is unavailable: {e}\n\
             (set STAGECRAFT_ONNX_SKIP_CONFORMANCE=1 to skip this test)"
        );
    }
    Some(root)
}

fn expected() -> BTreeSet<String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("conformance/expected_passes.txt");
    std::fs::read_to_string(&path)
        .expect("conformance/expected_passes.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

/// Eagerly and on the lazy device, every expected case of the `node` and
/// `light` suites passes too: the three modes agree.
#[test]
fn expected_cases_pass_eagerly_and_lazily() {
    let Some(root) = data() else { return };
    let expected = expected();
    for mode in [Mode::Eager, Mode::Lazy] {
        let report = conformance::run_suite(&root, &["node", "light"], mode, |_| {})
            .expect("the suite's folders are readable");
        let broken: Vec<String> = report
            .results
            .iter()
            .filter(|r| expected.contains(&r.id) && r.outcome != Outcome::Pass)
            .map(|r| format!("{}: {:?}", r.id, r.outcome))
            .collect();
        assert!(broken.is_empty(), "{mode:?}:\n{}", broken.join("\n"));
    }
}

#[test]
fn expected_cases_pass() {
    let Some(root) = data() else { return };
    let report = conformance::run_suite(&root, conformance::CATEGORIES, Mode::Function, |_| {})
        .expect("the suite's folders are readable");
    for cat in conformance::CATEGORIES {
        let c = report.counts(Some(cat));
        eprintln!(
            "{cat}: {} pass, {} fail, {} unsupported",
            c.pass, c.fail, c.unsupported
        );
    }
    let expected_path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("conformance/expected_passes.txt");
    if std::env::var_os("STAGECRAFT_ONNX_WRITE_EXPECTED").is_some() {
        let mut list = report.passes().join("\n");
        list.push('\n');
        std::fs::write(&expected_path, list).expect("write expected_passes.txt");
        std::fs::write(
            workspace().join("docs/onnx-conformance.md"),
            report.to_markdown(),
        )
        .expect("write docs/onnx-conformance.md");
    }
    let expected = expected();
    let regressions: Vec<String> = report
        .results
        .iter()
        .filter(|r| expected.contains(&r.id) && r.outcome != Outcome::Pass)
        .map(|r| format!("{}: {:?}", r.id, r.outcome))
        .collect();
    let seen: BTreeSet<&str> = report.results.iter().map(|r| r.id.as_str()).collect();
    let missing: Vec<&String> = expected
        .iter()
        .filter(|e| !seen.contains(e.as_str()))
        .collect();
    assert!(
        regressions.is_empty() && missing.is_empty(),
        "cases that passed before no longer pass:\n{}\nmissing cases: {missing:?}",
        regressions.join("\n")
    );
}
