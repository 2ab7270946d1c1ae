//! Helpers shared by the integration tests.

/// `n` reproducible values spread over `[lo, hi)` (a 64-bit LCG: the same
/// seed gives the same values in every test and run).
#[allow(dead_code)] // Each test binary compiles this module; not all call it.
pub fn values(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((s >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

/// The names of the ops and kernels that ran (eagerly or inside compiled
/// traces) while `f` ran. Profiling is process-wide: callers in one test
/// binary take turns, and a binary that uses this runs no other test that
/// profiles.
#[allow(dead_code)] // Each test binary compiles this module; not all call it.
pub fn kernels_run(f: impl FnOnce()) -> Vec<String> {
    use stagecraft::layers::runtime::profile;
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    profile::set_enabled(true);
    f();
    profile::set_enabled(false);
    profile::take_events()
        .into_iter()
        .filter(|e| e.category == profile::OP || e.category == profile::KERNEL)
        .map(|e| e.name.to_string())
        .collect()
}
