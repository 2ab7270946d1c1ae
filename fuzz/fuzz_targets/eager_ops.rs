//! Random op calls on the eager CPU device (sync and async execution):
//! every call succeeds or returns an error naming the op and its line.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagecraft_fuzz::op_calls;

fuzz_target!(|data: &[u8]| {
    if let Err(finding) = op_calls::run(data, false) {
        panic!("{finding}");
    }
});
