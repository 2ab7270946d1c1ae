//! The one item of `stagecraft-cpu`'s `isa` module that `sgemm.rs` reads,
//! for the binaries that include that file by path.

#[derive(PartialEq)]
pub enum IsaLevel {
    Avx512,
    Below,
}

pub fn level() -> IsaLevel {
    if std::arch::is_x86_feature_detected!("avx512f") {
        IsaLevel::Avx512
    } else {
        IsaLevel::Below
    }
}
