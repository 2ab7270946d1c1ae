//! The graph text parser fuzzer as a bounded proptest: arbitrary bytes,
//! and printed functions with a piece replaced, through the
//! `graph_text_parser` fuzz target's check (`fuzz/src/graph_text.rs`): no
//! panic, errors name the line, and what parses verifies and prints to a
//! fixed point.

use proptest::prelude::*;
use stagecraft_graph as graph;

#[path = "../../../fuzz/src/graph_text.rs"]
mod graph_text;

/// Runs the check on `bytes`, turning a panic into a failure.
fn run(bytes: &[u8]) -> Result<(), String> {
    match std::panic::catch_unwind(|| graph_text::check(bytes)) {
        Ok(result) => result,
        Err(_) => Err(format!("panicked on {:?}", String::from_utf8_lossy(bytes))),
    }
}

/// Hand-written functions in the text form: the starting points that are
/// then cut and spliced.
const SAMPLES: &[&str] = &[
    "@f(%0: f32[2]) -> (f32[2]) {\n  %1 = Neg(%0) : f32[2]\n  return (%1)\n}\n",
    "@hand(%x: f32[2,3], %b: bool[]) -> (f32[2,3]) {\n  %two = Const[dtype: f32, value: 2.0]()\n  \
     %y = Mul(%x, %two)\n  %z = Select(%b, %y, %x) : f32[2,3]   device \"cpu:0\"\n  return (%z)\n}\n",
    "@g(%a: f32[2,3], %c: f32[3]) {\n  %k = Const[dtype: f32, values: [1.5, -2.0, 0.25]]()\n  \
     %s = Add(%a, %k)\n  %r = Sum[axes: [0, 1], keepdim: true](%s)\n  \
     %p = Pad[pads: [1, 1], value: -0.5](%c)\n  return (%r, %p)\n}\n",
    "@m(%0: f64[2,2], %1: f64[2,2]) -> (f64[2,2], i64[2]) {\n  %2 = MatMul(%0, %1)\n  \
     %3 = ArgMax[axis: 1](%2)\n  return (%2, %3)\n}\n",
];

/// Pieces spliced into the samples: syntax, names and numbers at their
/// limits.
const PIECES: &[&str] = &[
    "",
    "%",
    "@",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    ",",
    ":",
    "#",
    "\"",
    "\\",
    "\n",
    "#1",
    "#999",
    "f32[]",
    "i64[18446744073709551615]",
    "bool[0,0]",
    "f32[2,",
    "-1",
    "1e400",
    "nan",
    "inf",
    "18446744073709551616",
    "Const[dtype: f32, value: 1.0]()",
    "Reshape[shape: [4]](%0)",
    "Transpose[perm: [1, 0]](%0)",
    "Slice[starts: [0], ends: [-1], steps: [0]](%0)",
    "Sum[axes: [7]](%0)",
    "device \"\"",
    "return ()",
    "%0 = Neg(%0)",
    "\u{0}",
    "é",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
        prop_assert_eq!(run(&bytes), Ok(()));
    }

    #[test]
    fn spliced_samples(
        sample in 0..SAMPLES.len(),
        cuts in proptest::collection::vec((any::<usize>(), 0usize..12, 0..PIECES.len()), 0..4),
    ) {
        let mut text = SAMPLES[sample].to_string();
        for (at, len, piece) in cuts {
            let mut start = at % (text.len() + 1);
            while !text.is_char_boundary(start) {
                start -= 1;
            }
            let mut end = (start + len).min(text.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.replace_range(start..end, PIECES[piece]);
        }
        prop_assert_eq!(run(text.as_bytes()), Ok(()));
    }
}

/// Every sample parses, so the splices start from valid text and the
/// success path's checks (verify, print fixed point) run.
#[test]
fn samples_parse_and_pass_the_check() {
    for s in SAMPLES {
        graph::text::parse(s).unwrap_or_else(|e| panic!("{e}\n{s}"));
        assert_eq!(run(s.as_bytes()), Ok(()), "{s}");
    }
}
