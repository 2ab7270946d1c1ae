//! Random op calls on the lazy device over the CPU (recorded, then traced,
//! compiled and cached when read or at `mark_step`): every call succeeds
//! or returns an error naming the op and its line.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagecraft_fuzz::op_calls;

fuzz_target!(|data: &[u8]| {
    if let Err(finding) = op_calls::run(data, true) {
        panic!("{finding}");
    }
});
