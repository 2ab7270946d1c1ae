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

/// Runs `f` with its loops compiled for [`level`]: `f` is inlined into a
/// function built with that level's target features, so plain iterator
/// loops inside it vectorize to AVX2 or AVX-512 instead of the build's
/// baseline SSE2. For short loops outside the kernels (the collectives'
/// reductions); each lane's operation is the same at every level, so a
/// loop without FMA-contractible arithmetic gives the same bits.
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn avx2<R>(f: impl FnOnce() -> R) -> R {
        f()
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn avx512<R>(f: impl FnOnce() -> R) -> R {
        f()
    }
    match level() {
        // SAFETY: `level` reports AVX2 only on a CPU that has it, which is
        // all `avx2` is compiled to use.
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => unsafe { avx2(f) },
        // SAFETY: as above, for AVX-512F.
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512 => unsafe { avx512(f) },
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loop run through `vectorized` (at this CPU's level) gives the
    /// bits the baseline loop gives, NaN and rounding included, and its
    /// value comes back.
    #[test]
    fn vectorized_loops_give_the_baseline_bits() {
        let a: Vec<f32> = (0..1037).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        let mut b: Vec<f32> = (0..1037).map(|i| 1.0 / (i as f32 + 0.5)).collect();
        b[5] = f32::NAN;
        let sum = |out: &mut Vec<f32>| {
            for ((o, &x), &y) in out.iter_mut().zip(&a).zip(&b) {
                *o = x + y;
            }
            out.len()
        };
        let mut plain = vec![0.0; a.len()];
        let mut fast = vec![0.0; a.len()];
        sum(&mut plain);
        assert_eq!(vectorized(|| sum(&mut fast)), a.len());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&plain), bits(&fast));
    }

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
