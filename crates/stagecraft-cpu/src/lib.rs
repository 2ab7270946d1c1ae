//! CPU kernels: one dispatch function per op, registered against the op
//! definitions of `stagecraft-ops`.
//!
//! A kernel receives dense host inputs (owned, so it may reuse a buffer it
//! holds the last reference to) and the output metadata that the op's
//! metadata function already computed; it never re-validates shapes. The
//! [`reference`](mod@reference) module holds slow, obviously correct versions of the same
//! ops that the tests compare against.

pub mod collective;
pub mod isa;
mod kernel;
mod kernels;
pub mod numeric;
pub mod pool;
pub mod reference;

pub use kernel::{
    registry, settle_by_shape, AnyKernel, CpuConstantKernels, Inputs, Kernel, KernelContext,
    KernelFactory, KernelRegistry, Outputs, ValueInputs, ValueKernel, ValueKernelFactory,
    ValueOutputs, CONSTANT_KERNELS,
};
pub use kernels::attention::{
    workspace_bytes as attention_workspace_bytes, Workspace as AttentionWorkspace,
};
pub use kernels::effects::{set_print_sink, PrintSink};

/// True when these kernels were compiled without optimization (a debug
/// build of a program that depends on stagecraft), which makes them 20 to
/// 35 times slower.
pub const UNOPTIMIZED: bool = cfg!(stagecraft_unoptimized);

/// What to tell the user about a build whose kernels are `unoptimized`,
/// unless `quiet` (the value of `STAGECRAFT_QUIET`) asks for silence.
pub fn unoptimized_warning(unoptimized: bool, quiet: Option<&str>) -> Option<&'static str> {
    let silenced = quiet.is_some_and(|q| !q.is_empty() && q != "0");
    (unoptimized && !silenced).then_some(
        "stagecraft: the kernels were compiled without optimization (a debug build), which \
         makes them 20-35x slower. Add to your Cargo.toml:\n\n    \
         [profile.dev.package.\"*\"]\n    opt-level = 3\n\n\
         or build with --release. STAGECRAFT_QUIET=1 silences this warning.",
    )
}

/// Prints [`unoptimized_warning`] to stderr, once per process.
pub fn warn_if_unoptimized() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let quiet = std::env::var("STAGECRAFT_QUIET").ok();
        if let Some(warning) = unoptimized_warning(UNOPTIMIZED, quiet.as_deref()) {
            eprintln!("{warning}");
        }
    });
}

/// Below this many elements a kernel runs on the calling thread: forking
/// onto the rayon pool costs more than it saves.
pub const PARALLEL_THRESHOLD: usize = 1 << 15;

#[cfg(test)]
mod unoptimized_tests {
    use super::unoptimized_warning;

    #[test]
    fn a_debug_build_is_told_once_how_to_fix_it_unless_quiet() {
        let warning = unoptimized_warning(true, None).unwrap();
        assert!(warning.contains("[profile.dev.package.\"*\"]"), "{warning}");
        assert!(warning.contains("opt-level = 3"), "{warning}");
        assert!(warning.contains("STAGECRAFT_QUIET=1"), "{warning}");
        assert_eq!(unoptimized_warning(true, Some("1")), None);
        assert!(unoptimized_warning(true, Some("0")).is_some());
        assert_eq!(unoptimized_warning(false, None), None);
    }
}
