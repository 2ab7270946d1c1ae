//! Shared code of the stagecraft fuzz targets.
//!
//! [`op_calls`] turns bytes into random op calls; the `eager_ops` and
//! `lazy_ops` targets run it, and so does the proptest
//! `crates/stagecraft/tests/fuzz_ops.rs`, which includes the same file.
//! [`cli_loaders`] and [`graph_text`] hold the checks of the three parser
//! targets, shared the same way with their proptests.

use stagecraft::layers::graph;

pub mod cli_loaders;
pub mod graph_text;
pub mod op_calls;
