//! Threads sharing `gpu:0`: eager ops and lazy traces from several threads
//! at once give the values they give one at a time.
//!
//! This failed before (a lazy result read back as zeros in most runs):
//! a thread submitting the open batch took its command buffer out under
//! the lock but submitted it after letting go, so another thread's
//! download could reach the queue first and copy results not yet
//! computed.

#![cfg(feature = "wgpu")]

use stagecraft::{Device, Rng, Tensor};

fn chain(x: &Tensor<f32>, w: &Tensor<f32>) -> Tensor<f32> {
    let h = x.matmul(w).tanh();
    let s = h.softmax(-1);
    (&s * &h).sum(&[1], false).exp()
}

/// `rounds` programs of seeded sizes and values on each of `devices`,
/// against the CPU.
fn run(thread: u64, devices: &[Device], rounds: u64) -> Result<(), String> {
    let cpu = Device::cpu();
    for round in 0..rounds {
        let seed = thread * 1_000 + round;
        let mut rng = Rng::new(seed);
        let n = 8 + (seed as usize % 24);
        let x = Tensor::<f32>::rand_uniform(&[n, 16], -1.0, 1.0, &mut rng, &cpu);
        let w = Tensor::<f32>::rand_uniform(&[16, n], -1.0, 1.0, &mut rng, &cpu);
        let want = chain(&x, &w).to_vec().map_err(|e| e.to_string())?;
        for device in devices {
            let got = chain(&x.to_device(device), &w.to_device(device))
                .to_vec()
                .map_err(|e| e.to_string())?;
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                if (g - w).abs() > 1e-4 * w.abs() + 1e-5 {
                    return Err(format!(
                        "thread {thread}, round {round}, {device}: element {i} is {g}, \
                         the CPU's {w}"
                    ));
                }
            }
        }
    }
    Ok(())
}

#[test]
fn threads_sharing_the_gpu_eagerly_and_lazily_get_the_values_of_one() {
    let gpu = Device::try_gpu(0).unwrap_or_else(|e| panic!("this test needs gpu:0: {e}"));
    let lazy = Device::lazy(&gpu);
    // An eager thread, a lazy one, and one that does both.
    let plans = [vec![gpu], vec![lazy], vec![gpu, lazy]];
    let threads: Vec<_> = plans
        .into_iter()
        .enumerate()
        .map(|(t, devices)| std::thread::spawn(move || run(t as u64, &devices, 100)))
        .collect();
    for thread in threads {
        if let Err(e) = thread.join().unwrap() {
            panic!("{e}");
        }
    }
}
