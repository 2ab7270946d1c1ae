//! The vector instruction set the CPU kernels run with: the best this CPU
//! has, or a lower one named by the `STAGECRAFT_CPU_ISA` environment
//! variable, read once per process.
//!
//! The kernels are multiversioned at run time (the default build targets
//! baseline x86-64), so one binary runs its AVX-512 loops on a CPU that has
//! AVX-512 and its AVX2 loops on one that has only AVX2. Forcing a lower
//! level on an AVX-512 machine measures what a machine without it gets,
//! and tests those loops where the CI machine would otherwise never run
//! them:
//!
//! ```sh
//! STAGECRAFT_CPU_ISA=avx2 cargo bench -p stagecraft --bench dispatch
//! STAGECRAFT_CPU_ISA=baseline target/release/stagecraft train
//! ```
//!
//! Values: `avx512`, `avx2` (with FMA), `baseline` (SSE2 on x86-64), case
//! insensitive. A level above what the CPU has gives what it has. The
//! setting covers stagecraft's own kernels (its f32 GEMM, fused elementwise
//! chains, reductions, attention); products it hands to faer (f64, and f32
//! where its own GEMM does not run) follow faer's own detection.

use std::sync::OnceLock;

/// The name of the environment variable that caps the instruction set.
pub const ENV: &str = "STAGECRAFT_CPU_ISA";

/// An instruction-set level, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IsaLevel {
    /// The target's baseline (SSE2 on x86-64): plain loops.
    Baseline,
    /// AVX2 with FMA: 8 f32 lanes.
    Avx2,
    /// AVX-512 F: 16 f32 lanes.
    Avx512,
}

impl IsaLevel {
    /// How the level is written in figures and host lines.
    pub fn name(self) -> &'static str {
        match self {
            IsaLevel::Baseline => "baseline (no AVX2)",
            IsaLevel::Avx2 => "AVX2+FMA",
            IsaLevel::Avx512 => "AVX-512",
        }
    }

    /// Parses a value of [`ENV`].
    pub fn parse(value: &str) -> Result<IsaLevel, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "avx512" | "avx-512" | "avx512f" => Ok(IsaLevel::Avx512),
            "avx2" => Ok(IsaLevel::Avx2),
            "baseline" | "sse2" | "none" => Ok(IsaLevel::Baseline),
            other => Err(format!(
                "{ENV}={other:?} is not an instruction set: use avx512, avx2 or baseline"
            )),
        }
    }
}

/// The level the kernels use: the CPU's, lowered to [`ENV`]'s where that
/// is set. An unreadable setting is reported once on stderr and ignored.
pub fn level() -> IsaLevel {
    static LEVEL: OnceLock<IsaLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let detected = detected();
        match std::env::var(ENV) {
            Ok(value) => match IsaLevel::parse(&value) {
                Ok(cap) => cap.min(detected),
                Err(message) => {
                    eprintln!("stagecraft: {message}; using {}", detected.name());
                    detected
                }
            },
            Err(_) => detected,
        }
    })
}

/// The best level this CPU runs. Miri interprets the baseline loops only
/// (scripts/miri.sh): std's feature detection reports nothing under it,
/// and saying so here keeps the vector paths out whatever it does.
pub fn detected() -> IsaLevel {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
            return IsaLevel::Avx512;
        }
        if avx2 {
            return IsaLevel::Avx2;
        }
    }
    IsaLevel::Baseline
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_cap_the_detected_level() {
        assert_eq!(IsaLevel::parse("AVX2"), Ok(IsaLevel::Avx2));
        assert_eq!(IsaLevel::parse(" avx512 "), Ok(IsaLevel::Avx512));
        assert_eq!(IsaLevel::parse("baseline"), Ok(IsaLevel::Baseline));
        let bad = IsaLevel::parse("neon").unwrap_err();
        assert!(
            bad.contains("STAGECRAFT_CPU_ISA") && bad.contains("avx2"),
            "{bad}"
        );
        assert!(IsaLevel::Baseline < IsaLevel::Avx2 && IsaLevel::Avx2 < IsaLevel::Avx512);
        assert!(level() <= detected());
    }
}
