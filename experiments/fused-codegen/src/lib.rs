//! An experiment, not part of the runtime: does generating machine code for
//! a fused elementwise program (with Cranelift) beat stagecraft's compiled
//! block interpreter by enough to pay for its compile time?
//!
//! - [`jit`] compiles a decoded `FusedInstr` program into one loop that
//!   keeps every intermediate in machine registers (f32x4 vectors and a
//!   scalar tail), and wraps it in a kernel shaped like the runtime's.
//! - [`interp`] calls the real `FusedElementwise` kernel through
//!   stagecraft-cpu's kernel registry, as the executor does.
//! - [`programs`] builds the programs both run: the B3 chain exactly as the
//!   fusion pass encodes it, and a long synthetic one for compile times.

pub mod interp;
pub mod jit;
pub mod programs;
