//! Marks a build of the kernels without optimization, which runs them
//! tens of times slower: the runtime warns about it once (see
//! `stagecraft_cpu::warn_if_unoptimized`).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(stagecraft_unoptimized)");
    println!("cargo::rerun-if-changed=build.rs");
    // Cargo gives a build script the opt-level of the package it builds,
    // profile overrides included.
    if std::env::var("OPT_LEVEL").as_deref() == Ok("0") {
        println!("cargo::rustc-cfg=stagecraft_unoptimized");
    }
}
