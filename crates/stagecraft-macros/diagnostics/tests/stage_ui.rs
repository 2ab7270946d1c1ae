//! Compile-time diagnostics of `#[stage]`, checked with trybuild: each
//! case in `tests/ui` must fail to compile with the message beside it.
//! Regenerate the expected output with `TRYBUILD=overwrite`.

#[test]
fn stage_diagnostics() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
