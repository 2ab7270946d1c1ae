//! Arbitrary text for the graph function parser: an error names the line,
//! a parsed function verifies and prints to text that parses back to the
//! same print.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagecraft_fuzz::graph_text;

fuzz_target!(|data: &[u8]| {
    if let Err(finding) = graph_text::check(data) {
        panic!("{finding}");
    }
});
