// Scratch: per-op kernel time of the lazy MLP autodiff step.
use stagecraft::layers::runtime::profile;
use stagecraft::{lazy, Device, Rng, Tensor};
use std::collections::BTreeMap;
use std::time::Instant;

fn main() {
    let d = Device::lazy(&Device::cpu());
    let mut rng = Rng::new(0);
    let dims = [784, 256, 256, 10];
    let mut w: Vec<Tensor<f32>> = (0..3).map(|i| Tensor::rand_normal(&[dims[i], dims[i + 1]], 0.0, 0.05, &mut rng, &d)).collect();
    let mut b: Vec<Tensor<f32>> = (0..3).map(|i| Tensor::zeros(&[dims[i + 1]], &d)).collect();
    let x = Tensor::<f32>::rand_uniform(&[128, 784], 0.0, 1.0, &mut Rng::new(1), &d);
    let labels: Vec<f32> = (0..1280).map(|i| if i % 10 == (i / 10) % 10 { 1.0 } else { 0.0 }).collect();
    let y = Tensor::<f32>::from_vec(labels, &[128, 10], &d).unwrap();
    lazy::mark_step();
    let mut step = |w: &mut Vec<Tensor<f32>>, b: &mut Vec<Tensor<f32>>| {
        let wg: Vec<Tensor<f32>> = w.iter().map(|t| t.requires_grad()).collect();
        let bg: Vec<Tensor<f32>> = b.iter().map(|t| t.requires_grad()).collect();
        let h1 = (x.matmul(&wg[0]) + &bg[0]).relu();
        let h2 = (h1.matmul(&wg[1]) + &bg[1]).relu();
        let logits = h2.matmul(&wg[2]) + &bg[2];
        let loss = -(logits.log_softmax(-1) * &y).sum(&[-1], false).mean(&[0], false);
        let grads = loss.backward().unwrap();
        for i in 0..3 {
            w[i] = &wg[i] - &(grads.get(&wg[i]).unwrap() * 0.01);
            b[i] = &bg[i] - &(grads.get(&bg[i]).unwrap() * 0.01);
        }
        loss
    };
    let mut step = |w: &mut Vec<Tensor<f32>>, b: &mut Vec<Tensor<f32>>| {
        let loss = step(w, b);
        if std::env::var("DUMP").is_ok() { let t = lazy::step_trace().unwrap(); println!("{}", stagecraft::layers::graph::text::print(&t.optimized)); std::process::exit(0); }
        lazy::mark_step();
        loss.wait().unwrap();
    };
    for _ in 0..std::env::var("WARM").map(|v| v.parse().unwrap()).unwrap_or(300) { step(&mut w, &mut b); }
    let n: usize = std::env::var("N").map(|v| v.parse().unwrap()).unwrap_or(2000);
    let t = Instant::now();
    for _ in 0..n { step(&mut w, &mut b); }
    println!("step: {:.3} ms (no profiling)", t.elapsed().as_secs_f64() * 1e3 / n as f64);
    profile::set_enabled(true);
    let _ = profile::take_events();
    let t = Instant::now();
    for _ in 0..n { step(&mut w, &mut b); }
    let wall = t.elapsed().as_secs_f64() * 1e3 / n as f64;
    profile::set_enabled(false);
    profile::set_enabled(true);
    step(&mut w, &mut b);
    profile::set_enabled(false);
    let mut evs = profile::take_events();
    evs.sort_by(|a, b| a.start_us.partial_cmp(&b.start_us).unwrap());
    let t0 = evs.first().map(|e| e.start_us).unwrap_or(0.0);
    if std::env::var("TIMELINE").is_ok() { for e in &evs[evs.len().saturating_sub(150)..] {
        println!("{:>8.1} {:>7.1} t{:<3} {} {}", e.start_us - t0, e.duration_us, e.thread, e.category, e.name);
    } }
    let mut by: BTreeMap<(String, String), (f64, usize)> = BTreeMap::new();
    for e in evs.iter() {
        let key = (e.category.to_string(), format!("{} {}", e.name, e.args.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")));
        let s = by.entry(key).or_default();
        s.0 += e.duration_us;
        s.1 += 1;
    }
    println!("step with profiling: {wall:.3} ms");
    let mut rows: Vec<_> = by.into_iter().collect();
    rows.sort_by(|a, b| b.1 .0.partial_cmp(&a.1 .0).unwrap());
    for ((cat, name), (us, count)) in rows.iter().take(40) {
        println!("{:>9.1} us/step {:>6} x/step  {cat:<10} {name}", us / n as f64, count / n);
    }
}
