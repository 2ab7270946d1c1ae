//! Arbitrary bytes as MNIST IDX images and labels files: an error names
//! the file, a parsed file encodes back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagecraft_fuzz::cli_loaders;

fuzz_target!(|data: &[u8]| {
    if let Err(finding) = cli_loaders::idx(data) {
        panic!("{finding}");
    }
});
