//! Tests only: `tests/stage_ui.rs` checks that each program in `tests/ui`
//! fails to compile with the `#[stage]` diagnostic beside it.
