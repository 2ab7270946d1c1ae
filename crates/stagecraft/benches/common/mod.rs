//! Programs shared by the bench files.

// Each bench file includes this module and uses only part of it.
#![allow(dead_code)]

use stagecraft::Tensor;

/// The B3 chain: t=x*2; t=t+1; t=t*x; t=t-3; relu; t=t*0.5; t=t+x; t=t*t.
pub fn b3(x: &Tensor<f32>) -> Tensor<f32> {
    let t = x * 2.0;
    let t = t + 1.0;
    let t = t * x;
    let t = t - 3.0;
    let t = t.relu();
    let t = t * 0.5;
    let t = t + x;
    &t * &t
}

/// The host line of a bench's header: CPU model, cores, the vector set the
/// kernels use (`STAGECRAFT_CPU_ISA` may force a lower one), and the rayon
/// threads.
pub fn host() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split(':').nth(1))
            .map(str::trim)
    };
    let model = field("model name").unwrap_or("unknown CPU");
    let isa = stagecraft::layers::cpu::isa::level();
    let detected = stagecraft::layers::cpu::isa::detected();
    let isa = if isa == detected {
        isa.name().to_string()
    } else {
        format!("{} (forced; the CPU has {})", isa.name(), detected.name())
    };
    format!(
        "{model}, {} cores, {isa}, {} rayon threads",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        rayon::current_num_threads()
    )
}
