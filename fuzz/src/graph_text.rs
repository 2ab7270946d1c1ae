//! The check of the `graph_text_parser` target, shared with its proptest
//! (`crates/stagecraft-graph/tests/fuzz_text.rs` includes this file). The
//! includer provides `graph` (the `stagecraft-graph` crate) in the parent
//! module, since the graph crate's own tests cannot name `stagecraft`.
//!
//! A panic is the caller's to catch.

use super::graph::{text, verify};

/// Parses `bytes` (as UTF-8, invalid sequences replaced) as a graph
/// function's text. An error must name the line unless the text is blank;
/// a parsed function must pass the verifier, and printing it must give
/// text that parses back to a function printing the same.
pub fn check(bytes: &[u8]) -> Result<(), String> {
    let source = String::from_utf8_lossy(bytes);
    match text::parse(&source) {
        Ok(f) => {
            verify(&f).map_err(|e| format!("parsed a function the verifier rejects: {e}"))?;
            let printed = text::print(&f);
            let again = text::parse(&printed).map_err(|e| {
                format!("the printed form of a parsed function does not parse: {e}\n{printed}")
            })?;
            let reprinted = text::print(&again);
            if reprinted != printed {
                return Err(format!(
                    "printing is not a fixed point:\n{printed}\nthen\n{reprinted}"
                ));
            }
        }
        Err(e) => {
            let blank = source.lines().all(|l| l.trim().is_empty());
            if !blank && !e.to_string().contains("line ") {
                return Err(format!("a parse error that names no line: {e}"));
            }
        }
    }
    Ok(())
}
