//! Arbitrary bytes as a safetensors checkpoint of each model: an error names
//! the file, a loaded model has the shapes of its kind.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagecraft_fuzz::cli_loaders;

fuzz_target!(|data: &[u8]| {
    if let Err(finding) = cli_loaders::safetensors(data) {
        panic!("{finding}");
    }
});
